"""Plain-PyTorch model of the whole exchange over all ranks: the test oracle.

It follows the contract of DESIGN.md section 3 directly (expert -> rank
ranges from :mod:`torch_moe_a2a.layout`, distinct destinations, slots in
increasing token order, fp32 sums in ascending rank order) and never calls
``torch.ops.moe_a2a``, so it checks the kernels rather than repeating them.
Loops run over ranks; work over tokens is vectorized (except building the
per-token ``routes`` lists). Everything is computed on the device of the
inputs and returned there, so on a GPU the oracle runs at GPU speed. Also
holds the toy MoE of the demo and tests and a routing generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Optional

import torch
from torch import Tensor

from . import layout


@dataclass
class RefDispatch:
    """What the dispatch of every rank produces, per the contract.

    recv[d][i]: ``[ep_size, T, *trail_i]`` payload ``i`` received by rank
    ``d``; row ``[s, j]`` is the j-th token (in token order) that rank ``s``
    sent to ``d``; padding rows are zero. recv_counts[d]: int32 ``[ep_size]``,
    ``[s]`` = rows ``d`` received from ``s``. routes[s][t]: the ``(dest,
    slot)`` pairs of token ``t`` of rank ``s``, ascending ``dest``.
    invalid_counts[s]: ids ``>= num_experts`` rank ``s`` saw (skipped).
    slot_table[s]: int64 ``[local_num_tokens, ep_size]``, the slot of token
    ``t`` at rank ``d`` or -1 (``routes`` as a tensor, for reference_combine).
    Every tensor lives on the device reference_dispatch ran on (its inputs').
    """

    recv: list[list[Tensor]]
    recv_counts: list[Tensor]
    routes: list[list[list[tuple[int, int]]]]
    invalid_counts: list[int]
    slot_table: list[Tensor] = field(default_factory=list, repr=False)


def _expert_owner(num_experts: int, ep_size: int, device: torch.device) -> Tensor:
    """int64 ``[num_experts]`` on ``device``: the rank owning each expert (contiguous ranges)."""
    counts = torch.tensor(layout.experts_per_rank(num_experts, ep_size), device=device)
    return torch.repeat_interleave(torch.arange(ep_size, device=device), counts)


def _bytes_per_row(payload: Tensor) -> int:
    return math.prod(payload.shape[1:]) * payload.element_size()


def _from_row_bytes(rows: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """``shape`` of ``dtype`` from uint8 rows ``rows`` (the inverse of _row_bytes;
    rows of 0 bytes, which a dtype view cannot reinterpret, give an empty tensor)."""
    if rows.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=rows.device)
    return rows.view(dtype).view(shape)


def _row_bytes(payload: Tensor) -> Tensor:
    """uint8 ``[n, row_bytes]``: the bytes of each row of ``[n, *]`` ``payload``.

    Dispatch only moves rows, so the oracle moves bytes: the result is exact for
    every dtype (fp8 and NaN patterns included) on every device.
    """
    flat = payload.detach().contiguous().reshape(-1)  # stride 1 even where a size-1 dim had another stride
    return flat.view(torch.uint8).view(payload.shape[0], _bytes_per_row(payload))


def reference_dispatch(
    token_selected_experts: list[Tensor],
    input_payloads: list[list[Tensor]],
    *,
    ep_size: int,
    num_experts: int,
    runtime_max_tokens_per_rank: int,
    active_ranks: Optional[Collection[int]] = None,
) -> RefDispatch:
    """Dispatch of every rank at once.

    token_selected_experts[s]: ``[N_s, top_k]`` integer ids of rank ``s``
    (negative: none; ``>= num_experts``: skipped and counted).
    input_payloads[s][i]: ``[N_s, *trail_i]`` payload ``i`` of rank ``s``.
    active_ranks: the ranks taking part (None: all); an inactive rank neither
    sends nor receives, and tokens routed to it are dropped.
    Runs on the device of ``token_selected_experts[0]`` (other inputs are
    moved there) and returns every tensor on that device; the inputs are
    only read.
    """
    T = runtime_max_tokens_per_rank
    device = token_selected_experts[0].device
    active = set(range(ep_size)) if active_ranks is None else {int(r) for r in active_ranks}
    owner = _expert_owner(num_experts, ep_size, device)
    templates = input_payloads[0]
    # Receive planes as bytes [ep_size, T, row_bytes]; viewed as the payloads' dtypes and shapes at the end.
    recv_bytes = [
        [torch.zeros((ep_size, T, _bytes_per_row(p)), dtype=torch.uint8, device=device) for p in templates]
        for _ in range(ep_size)
    ]
    recv_counts = [torch.zeros(ep_size, dtype=torch.int32, device=device) for _ in range(ep_size)]
    routes: list[list[list[tuple[int, int]]]] = []
    invalid_counts: list[int] = []
    slot_table: list[Tensor] = []

    for s in range(ep_size):
        ids = token_selected_experts[s].detach().to(device).long()
        payloads = [_row_bytes(p.to(device)) for p in input_payloads[s]]
        n = ids.shape[0]
        if n > T:
            raise ValueError(f"rank {s} has {n} tokens > runtime_max_tokens_per_rank {T}")
        invalid_counts.append(int((ids >= num_experts).sum()) if s in active else 0)
        valid = (ids >= 0) & (ids < num_experts)
        dest = torch.where(valid, owner[ids.clamp(0, num_experts - 1)], -1)  # [n, top_k]
        slots = torch.full((n, ep_size), -1, dtype=torch.int64, device=device)
        if s in active:
            for d in sorted(active):
                hit = (dest == d).any(dim=1)  # distinct destinations: once per rank
                count = int(hit.sum())
                slots[hit, d] = torch.arange(count, device=device)
                recv_counts[d][s] = count
                for plane, rows in zip(recv_bytes[d], payloads):
                    plane[s, :count] = rows[hit]
        slot_table.append(slots)
        routes.append([[(d, slot) for d, slot in enumerate(row) if slot >= 0] for row in slots.tolist()])
    recv = [
        [_from_row_bytes(plane, p.dtype, (ep_size, T, *p.shape[1:])) for plane, p in zip(planes, templates)]
        for planes in recv_bytes
    ]
    return RefDispatch(recv, recv_counts, routes, invalid_counts, slot_table)


def _slot_table_from_routes(routes: list[list[tuple[int, int]]], ep_size: int, device: torch.device) -> Tensor:
    table = torch.full((len(routes), ep_size), -1, dtype=torch.int64, device=device)
    for t, pairs in enumerate(routes):
        for d, slot in pairs:
            table[t, d] = slot
    return table


def reference_combine(
    expert_outputs: list[Tensor],
    ref: RefDispatch,
    local_num_tokens: list[int],
    output_dtype: Optional[torch.dtype] = None,
) -> list[Tensor]:
    """Combine of every rank at once.

    expert_outputs[r]: ``[ep_size, T, *trail]`` rank ``r``'s outputs for the
    rows it received (only the rows of ``ref``'s routes are read). Returns,
    per source rank ``s``, a new ``[local_num_tokens[s], *trail]`` tensor of
    ``output_dtype`` (default: the outputs' dtype) on the device of
    ``expert_outputs[0]`` (the others are moved there): for each token,
    starting from fp32 zeros, the rows of its destinations added in
    ascending rank order in fp32, then cast once. IEEE fp32 adds in a fixed
    order, so the result is the same bits on every device.
    """
    ep_size = len(expert_outputs)
    device = expert_outputs[0].device
    outputs = [e.detach().to(device) for e in expert_outputs]
    dtype = outputs[0].dtype if output_dtype is None else output_dtype
    trail = outputs[0].shape[2:]
    results = []
    for s in range(ep_size):
        n = local_num_tokens[s]
        if ref.slot_table:
            slots = ref.slot_table[s].to(device)
        else:
            slots = _slot_table_from_routes(ref.routes[s], ep_size, device)
        acc = torch.zeros((n, *trail), dtype=torch.float32, device=device)
        for d in range(ep_size):
            tokens = (slots[:n, d] >= 0).nonzero().squeeze(1)
            acc[tokens] += outputs[d][s, slots[tokens, d]].float()
        results.append(acc.to(dtype))
    return results


def toy_moe(
    recv_hidden: Tensor,
    recv_expert_ids: Tensor,
    recv_weights: Tensor,
    recv_counts: Tensor,
    *,
    ep_rank: int,
    ep_size: int,
    num_experts: int,
) -> Tensor:
    """A deterministic stand-in for a rank's experts.

    recv_hidden ``[ep_size, T, *H]``, recv_expert_ids (integer) and
    recv_weights (floating) ``[ep_size, T, top_k]``, recv_counts ``[ep_size]``:
    what dispatch delivered to rank ``ep_rank``. Returns a new ``[ep_size, T,
    *H]`` tensor of recv_hidden's dtype on its device: for a valid row ``[s,
    j]`` (``j < recv_counts[s]``) the sum over the columns k whose expert
    ``e_k`` this rank owns of ``w_k * hidden * (1 + e_k / num_experts)``,
    computed in fp32 as ``hidden * sum_k(w_k * (1 + e_k / num_experts))``;
    padding rows are 0 whatever they held.
    """
    first, last = layout.expert_range(num_experts, ep_size, ep_rank)
    ids = recv_expert_ids.long()
    owned = (ids >= first) & (ids < last)
    scale = torch.where(owned, recv_weights.float() * (1.0 + ids.float() / num_experts), 0.0).sum(dim=-1)
    T = recv_hidden.shape[1]
    valid = torch.arange(T, device=recv_hidden.device) < recv_counts.to(recv_hidden.device).long().unsqueeze(1)
    scale = torch.where(valid, scale, 0.0)
    expand = (*scale.shape, *([1] * (recv_hidden.dim() - 2)))
    out = recv_hidden.float() * scale.view(expand)
    out = torch.where(valid.view(expand), out, 0.0)  # also clears NaN/inf garbage in padding rows
    return out.to(recv_hidden.dtype)


def random_routing(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    generator: Optional[torch.Generator],
    *,
    invalid_fraction: float = 0.0,
    negative_fraction: float = 0.0,
) -> Tensor:
    """int32 ``[num_tokens, top_k]`` expert ids on the generator's device, distinct within each token.

    Each token gets ``min(top_k, num_experts)`` distinct random experts; when
    ``top_k > num_experts`` the remaining columns are -1 (no expert). Then
    about ``invalid_fraction`` of the entries become ids in ``[num_experts,
    2 * num_experts)`` and about ``negative_fraction`` become -1 (disjoint
    entries). ``generator``: a ``torch.Generator`` of any device (a CUDA one
    makes the ids on that GPU), or None (the CPU's default generator).
    """
    if top_k < 1 or num_experts < 1:
        raise ValueError(f"top_k ({top_k}) and num_experts ({num_experts}) must be >= 1")
    device = generator.device if generator is not None else torch.device("cpu")
    ids = torch.rand((num_tokens, num_experts), generator=generator, device=device).argsort(dim=1)[:, :top_k]
    if top_k > num_experts:
        ids = torch.cat(
            [ids, torch.full((num_tokens, top_k - num_experts), -1, dtype=ids.dtype, device=device)], dim=1
        )
    u = torch.rand((num_tokens, top_k), generator=generator, device=device)
    invalid = u < invalid_fraction
    negative = (u >= invalid_fraction) & (u < invalid_fraction + negative_fraction)
    bad_ids = num_experts + torch.randint(
        0, num_experts, (num_tokens, top_k), generator=generator, device=device
    )
    ids = torch.where(invalid, bad_ids, ids)
    ids = torch.where(negative, torch.full_like(ids, -1), ids)
    return ids.to(torch.int32)
