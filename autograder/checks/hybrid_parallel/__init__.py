"""Checks for notebook 08_hybrid_parallel: ``check_parallel_groups``, ``check_dispatch_tokens``,
``check_combine_tokens``, ``check_activation_bytes``, ``check_fits``.

* ``parallel_groups`` is compared, for many shapes drawn at grading time (up to thousands of ranks), with the layout
  rule rank = tp_rank + tp·dp_rank + tp·dp·pp_rank, and on 4 real ranks with the groups of
  ``init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``. Group order does not matter.
* ``dispatch_tokens`` / ``combine_tokens`` run on 2, 3 and 4 ranks with random routing (uneven counts, an expert
  that receives nothing, a rank with no tokens), float32 and float64, against the single-process layer computed
  inside every worker from all ranks' inputs. ``combine_tokens`` is fed the reference dispatch, so each exercise is
  graded on its own. How: the student's function runs in the grading sandbox of each rank (``in_sandbox``), whose
  only way to the other ranks is its host, and which writes only its own folder (ranks share no files); the host
  carries every all-to-all and its ``CommCounter`` must show the rows crossing: at least the rows bound for other
  ranks, at most every row once plus a little metadata; no send/recv. And the rows returned must be those the
  all-to-all delivered: every row another rank sends arrives changed (``moe._InTransit``, in the host, replaces it in
  the call's output buffer by a row drawn at grading time that no rank holds), so rows that came another way are
  the originals, where the check expects the stand-ins (the defence that remains where no sandbox runs).
* ``activation_bytes`` and ``fits`` are compared with the formulas of Korthikanti et al. 2022 (Table 2) and of
  the ZeRO paper (Rajbhandari et al. 2020), and ``fits``'s step time with the notebook's model (Narayanan et al.
  2021's FLOPs, the bubble, α-β costs of the communication), restated here as oracles, on drawn clusters too.

Probes keep the ranks in step: after every case each rank reports what it found (``all_gather_object``, outside the
counted region) and all stop together with the first rank's message. A student's exception is raised at once (the
other ranks may be waiting in a collective), and the launcher stops the rest.

The package: ``groups`` (parallel_groups), ``moe`` (dispatch and combine), ``planner`` (activation_bytes, fits).
"""

from __future__ import annotations

from .groups import check_parallel_groups, reference_parallel_groups
from .moe import check_combine_tokens, check_dispatch_tokens, moe_cases, reference_dispatch
from .planner import (check_activation_bytes, check_fits, reference_activation_bytes, reference_fits,
                      reference_step_time)

__all__ = ["check_parallel_groups", "check_dispatch_tokens", "check_combine_tokens", "check_activation_bytes",
           "check_fits", "reference_parallel_groups", "reference_dispatch", "reference_activation_bytes",
           "reference_fits", "reference_step_time", "moe_cases"]
