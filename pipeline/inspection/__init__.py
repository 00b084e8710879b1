"""Looking into a scored dataset: summary, validation, vocabulary overlap, alignment report, HTML
and PNG pictures. Library code only (no Hydra); ``stages/inspect.py`` composes the config and calls
:mod:`~pipeline.inspection.commands`. Every module reads the data through the contract's one reader,
:class:`storage_schemas.reader.ScoredDataset`.

Modules, in the order a user meets them:

* :mod:`~pipeline.inspection.commands`: the ``make inspect`` commands, one function each;
* :mod:`~pipeline.inspection.summary`: documents, tokens, bytes per token, loss quantiles (from a
  streamed histogram), NaN share, skipped documents, per-shard table, extreme documents;
* :mod:`~pipeline.inspection.validate`: every invariant of the data contract, every problem listed;
* :mod:`~pipeline.inspection.vocab_overlap`: raw and normalised vocabulary overlap;
* :mod:`~pipeline.inspection.align_report`: how a student tokenizer aligns with the teacher tokens;
* :mod:`~pipeline.inspection.html` and :mod:`~pipeline.inspection.plots`: pictures
  (:mod:`~pipeline.inspection.pieces`: the loss colour scale and text pieces they share);
* :mod:`~pipeline.inspection.terminal`: rich tables and coloured text for the terminal.
"""
