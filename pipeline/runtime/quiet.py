"""Third-party output that says nothing to a user of the stages, turned off at its source.

* transformers' own progress bars (``Loading weights`` on every model load, ``Writing model
  shards`` on every checkpoint save): through transformers' tqdm hook, so other progress bars
  (downloads from the hub, the stages' own) stay;
* the Trainer's note that checkpoint folders written within a second of each other are ordered by
  their step numbers rather than their times (what the project wants anyway).

Ray's notes are handled where Ray starts (:func:`pipeline.score_teacher.ray_cluster.init_ray`), the data
loader's ``pin_memory`` warning where the training arguments are made (pinned memory only on a GPU).
"""

from __future__ import annotations

import logging

TRAINER_NOTES = ("mtime may not be reliable on this filesystem",)


def _without_bar(factory, args, kwargs):
    return factory(*args, **{**kwargs, "disable": True})


class _DropNotes(logging.Filter):
    def __init__(self, notes: tuple[str, ...]):
        super().__init__()
        self.notes = notes

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(note in record.getMessage() for note in self.notes)


def quiet_third_party() -> None:
    """Turn off the output listed in the module docstring, in this process (idempotent). transformers
    is imported here, not with the module: an entry point that refuses its configuration never loads it."""
    from transformers.utils import logging as hf_logging  # heavy: a refused configuration never loads it

    hf_logging.set_tqdm_hook(_without_bar)
    trainer_log = logging.getLogger("transformers.trainer_utils")
    if not any(isinstance(f, _DropNotes) for f in trainer_log.filters):
        trainer_log.addFilter(_DropNotes(TRAINER_NOTES))
