"""The student edition's README (``python -m autograder student-edition``), as templates: ``{table}`` is the list of
notebooks, ``{demos}`` the section on the GPU demos (its lead-in is ``DEMOS_INTRO``), ``{stub}`` what an answer
cell holds before it is written; ``<URL of this repository>`` is replaced by ``--url``.

A translated edition (``--lang zh``) takes its README from the catalog ``i18n/LANG/edition.po`` (entries
``README.md`` and ``README.md: demos``), where each translation carries the hash of the English it was made from
(``autograder/translation.py``); ``python -m autograder.translation update`` brings the catalog in step with these
templates, and ``tests/test_translations.py`` fails while a translation is stale.
"""

README = """# Distributed training, built from `send` and `recv`

A hands-on course in how deep-learning training is spread over many processes. Each notebook takes one idea
(collectives, the ring all-reduce, data parallelism, tensor and pipeline parallelism, ZeRO, FSDP, hybrid 3D
parallelism and mixture-of-experts, what a real run needs: data sharding, clipping, loss scaling, sharded
checkpoints and restarts, and hiding communication behind computation), explains it, has you implement it from
lower-level parts on **real multi-process `torch.distributed` workers started from a notebook cell**, checks your
work, and compares it with PyTorch's own implementation. Everything runs on a laptop with no GPU.

## Start

```bash
./course lab    # first time: sets up .venv with the CPU build of PyTorch, then opens JupyterLab
```

Needs Python 3.10+ and bash (Linux or macOS). `./course plan` says what set-up would do, without installing
anything. Conda users: `conda env create -f environment.yml`, activate it, then `COURSE_VENV=none ./course lab`.

On Colab or Kaggle, install the course package into the notebook's Python first. It brings only what the notebooks
need; the runtime's torch, Jupyter and IPython are kept:

```python
%pip install -q "git+<URL of this repository>"
```
{demos}
## Work

The notebooks are in `notebooks/`, in order:

{table}

1. Open the next notebook, read, and fill in each exercise cell (`{stub}`).
2. The cell after each exercise is a quick visible test: run it.
3. The **Validate** button in the notebook's toolbar saves the notebook, runs it from the top in a fresh kernel and
   shows a checklist: a line per exercise saying that it passes, is not started (it still raises
   `NotImplementedError`) or fails, with the first line of its message; then the details of the first failure.
4. When you are done, check the whole notebook in a fresh kernel:
   ```bash
   .venv/bin/python -m autograder check notebooks/01_collectives/01_collectives.ipynb
   ```
   It prints, per exercise, whether its visible tests pass, and an estimate of your score. Grading also runs
   hidden tests with inputs drawn at grading time and checks *how* you got the answer (a from-scratch collective
   that calls the built-in loses its points), and it looks only at what your exercise cells define.
5. Hand in the notebook file itself (`notebooks/ID/ID.ipynb`), with your answers in the exercise cells.

Grading runs your notebook top to bottom and, separately, runs the hidden tests on the functions and classes your
exercise cells define. Code that reaches into the grader, IPython or private parts of PyTorch is flagged for your
instructor to review; honest answers never need it.

## Running workers from a cell

```python
import torch, torch.distributed as dist, labsupport

def work(scale):
    x = torch.tensor([float(dist.get_rank())], device=labsupport.device())
    dist.all_reduce(x)
    return x.item() * scale

labsupport.run(work, 10, world_size=4)      # [60.0, 60.0, 60.0, 60.0], in rank order
```

`help(labsupport)` describes `run`, `CommCounter`, `Timeline`, `%%distributed` and what a failing or
deadlocked rank looks like.
"""

DEMOS_INTRO = """The notebooks in `demos/` are made for a runtime with GPUs (Kaggle offers two T4s). They run on a
CPU too, and say which numbers would differ on GPUs:"""
