"""The student's data: scored text tokenized with the student's tokenizer, its tokens aligned to
one or several teachers', packed into training sequences, and the shards held out of training for
evaluation. Shared by stage 2 and the export. Its modules:

* :mod:`.settings`: the alignment and packing settings and the checks made before any token is
  counted (scored folders, teacher weights, the alignment the tokenizers allow); imports no torch;
* :mod:`.lengths`: the documents' student token counts, cached, counted once per distributed run;
* :mod:`.packing`: the documents' order and the packing plan (which samples hold which tokens);
* :mod:`.dataset`: the packed dataset, whose workers tokenize, align and slice the documents;
* :mod:`.several_teachers`: several teachers' documents matched and their losses combined;
* :mod:`.build`: all of it together, :func:`.build.build_student_data`;
* :mod:`.held_out_shards`: the shards held out of training for evaluation.

It may import :mod:`pipeline.runtime`, :mod:`pipeline.method` and the contract; not the folders'
records (beside it, on the same floor) nor any stage.
"""
