"""One module per lesson, named like its notebook: the helpers a notebook uses (demo models, measurement harness,
simulators, plots), so that the notebook itself holds what a student reads.

==================  ======================================  ==========================================
notebook            lesson module                           checks (``autograder/checks/``)
==================  ======================================  ==========================================
00_launch           ``labsupport.lessons.launch``           ``launch.py``
01_collectives      ``labsupport.lessons.collectives``      ``collectives/``
02_ring_allreduce   ``labsupport.lessons.ring_allreduce``   ``ring_allreduce/``
03_data_parallel    ``labsupport.lessons.data_parallel``    ``data_parallel/``
04_tensor_parallel  ``labsupport.lessons.tensor_parallel``  ``tensor_parallel/``
05_pipeline_parallel ``labsupport.lessons.pipeline_parallel`` ``pipeline_parallel/``
06_zero             ``labsupport.lessons.zero``             ``zero.py``
07_fsdp             ``labsupport.lessons.fsdp``             ``fsdp.py``
08_hybrid_parallel  ``labsupport.lessons.hybrid_parallel``  ``hybrid_parallel/``
==================  ======================================  ==========================================

Nothing here computes an exercise's answer: students receive this package. A lesson module imports torch;
``import labsupport`` does not import any lesson.
"""
