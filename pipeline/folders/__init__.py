"""The folders the pipeline writes and reads, and their records: a scored dataset's output folder
and lock (:mod:`.output_folder`, :mod:`.folder_lock`), its shards (:mod:`.shard_folder`), its card
(:mod:`.dataset_card`), the identities and provenance of what made it (:mod:`.provenance`,
:mod:`.model_source`), rehearsal output (:mod:`.rehearsal`) and the export's layout
(:mod:`.export_folder`).

It may import :mod:`pipeline.runtime`, :mod:`pipeline.method` and the contract; not the student's
data (beside it, on the same floor) nor any stage.
"""
