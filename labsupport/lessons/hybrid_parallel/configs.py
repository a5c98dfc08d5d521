"""What a planner is given (a model, a cluster) and the configurations the papers trained.

Sources:

* Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021
  (arXiv 2104.04473): Table 1 (the weak-scaling runs, A100 80 GB, 8 per node), and the parameter count
  P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) of its section 5.1 (V = 51200, s = 2048).
* Brown et al., "Language Models are Few-Shot Learners", 2020 (arXiv 2005.14165), Table 2.1: GPT-3 175B has 96
  layers, d_model 12288, 96 heads, context 2048.
* NVIDIA DGX A100 datasheet: 8 A100 80 GB per node, 312 TFLOP/s dense fp16/bf16 per GPU, NVLink/NVSwitch 300 GB/s
  per GPU in each direction, 8 × 200 Gb/s InfiniBand per node (25 GB/s per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Model", "Cluster", "GPT3_175B", "NARAYANAN_TABLE1", "DGX_A100"]


@dataclass(frozen=True)
class Model:
    """A GPT-style model and its training batch.

    ``num_layers`` l, ``hidden`` h, ``heads`` a, ``seq_len`` s, ``vocab`` V, ``global_batch`` B (sequences per
    optimizer step). ``num_params`` is Narayanan et al. 2021's count 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))
    (the transformer layers, embeddings and position embeddings)."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    seq_len: int = 2048
    vocab: int = 51200
    global_batch: int = 1536

    @property
    def num_params(self) -> float:
        l, h = self.num_layers, self.hidden
        return 12 * l * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq_len) / (12 * l * h))


@dataclass(frozen=True)
class Cluster:
    """GPUs and their links. ``memory_bytes`` per GPU; ``peak_flops`` per GPU (16-bit matmuls);
    ``efficiency`` the fraction of peak a well-tuned matmul-bound step reaches; ``intra_bw`` / ``inter_bw`` bytes/s
    per GPU inside a node / between nodes (one direction); ``alpha`` seconds per message (latency)."""

    name: str
    num_gpus: int
    gpus_per_node: int = 8
    memory_bytes: float = 80e9
    peak_flops: float = 312e12
    efficiency: float = 0.5
    intra_bw: float = 300e9
    inter_bw: float = 25e9
    alpha: float = 10e-6


def DGX_A100(num_gpus: int) -> Cluster:
    """``num_gpus`` A100 80 GB in DGX A100 nodes (8 per node), as in Narayanan et al. 2021."""
    return Cluster(f"{num_gpus} × A100 80GB", num_gpus)


#: GPT-3 175B (Brown et al. 2020, Table 2.1), with a global batch of 1536 sequences, the batch Narayanan et al. 2021
#: use to estimate GPT-3's training time on 1024 A100s.
GPT3_175B = Model("GPT-3 175B", num_layers=96, hidden=12288, heads=96, seq_len=2048, global_batch=1536)

#: Rows of Table 1 of Narayanan et al. 2021 (the larger models, where t·p > 8): the model, tensor-parallel size t,
#: pipeline size p, number of GPUs, global batch, and the measured TFLOP/s per GPU. Data-parallel size d = GPUs / (t·p).
#: The paper recomputes activations to fit models of this size (the notebook's planner shows why). ``Model.num_params``
#: reproduces the paper's parameter counts (39.1B, 76.1B, 145.6B, 310.1B, 529.6B, 1008.0B).
NARAYANAN_TABLE1 = [
    dict(model=Model("39.1B", 48, 8192, 64, global_batch=1536), t=8, p=2, gpus=512, tflops=138),
    dict(model=Model("76.1B", 60, 10240, 80, global_batch=1792), t=8, p=4, gpus=1024, tflops=140),
    dict(model=Model("145.6B", 80, 12288, 96, global_batch=2304), t=8, p=8, gpus=1536, tflops=148),
    dict(model=Model("310.1B", 96, 16384, 128, global_batch=2160), t=8, p=16, gpus=1920, tflops=155),
    dict(model=Model("529.6B", 105, 20480, 128, global_batch=2520), t=8, p=35, gpus=2520, tflops=163),
    dict(model=Model("1008.0B", 128, 25600, 160, global_batch=3072), t=8, p=64, gpus=3072, tflops=163),
]
