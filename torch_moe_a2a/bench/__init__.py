"""The benchmarks of ``python -m torch_moe_a2a bench`` and ``bench-dist``.

- ``common``: what both share: model presets and points, seeded inputs and
  their byte counts, the clock and CUDA-graph replays, the comparisons with
  the reference, progress, tables and JSON.
- ``single``: ``bench``, simulated expert parallelism on one device, next to
  a plain-PyTorch exchange.
- ``distributed``: ``bench-dist``, one rank per process under torchrun, next
  to ``all_to_all_single`` and NCCL's all-to-all on equal bytes.
- ``targets``: the speed targets both judge their numbers against.

Nothing is imported here: ``import torch_moe_a2a.bench.single`` loads only
what the single-device benchmark needs.
"""
