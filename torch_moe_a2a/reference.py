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
    *,
    low_precision: Optional[str] = None,
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

    ``low_precision``: ``"e4m3"`` or ``"e4m3_block_scaled"``: every row
    contributes what :func:`low_precision_values` makes of it (the default
    output dtype is then bf16).
    """
    ep_size = len(expert_outputs)
    device = expert_outputs[0].device
    outputs = [e.detach().to(device) for e in expert_outputs]
    dtype = outputs[0].dtype if output_dtype is None else output_dtype
    if low_precision is not None:
        outputs = [low_precision_values(o, block_scaled=low_precision == "e4m3_block_scaled") for o in outputs]
        dtype = torch.bfloat16 if output_dtype is None else output_dtype
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


@dataclass
class RefExpertMajor:
    """What the expert-major dispatch of every rank produces, per the contract.

    planes[d][i]: ``[L_d, M, *trail_i]`` payload ``i`` as rank ``d`` receives it
    grouped by its local experts (``L_d`` of them); padding rows zero.
    counts[d]: int32 ``[L_d]``. local_ids[d]: int32 ``[L_d, M]``, ``e`` in
    valid rows, -1 in padding. weights[d]: fp32 ``[L_d, M]``, the pair's
    router weight (1 when none was given), 0 in padding. dropped[d]: pairs
    beyond ``M`` that rank ``d`` dropped. For the combine, per source rank
    ``s``: pair_dest[s], pair_row[s] (int64) and pair_weight[s] (fp32), each
    ``[N_s, top_k]``: the token's kept pairs in the combine's order (ascending
    destination rank, local expert, top-k slot), as the destination and the
    row ``e * M + i`` of its expert-major planes; -1 / 0 after the last.
    """

    planes: list[list[Tensor]]
    counts: list[Tensor]
    local_ids: list[Tensor]
    weights: list[Tensor]
    dropped: list[int]
    pair_dest: list[Tensor]
    pair_row: list[Tensor]
    pair_weight: list[Tensor]
    max_tokens_per_expert: int


def reference_dispatch_expert_major(
    token_selected_experts: list[Tensor],
    input_payloads: list[list[Tensor]],
    router_weights: Optional[list[Tensor]],
    *,
    ep_size: int,
    num_experts: int,
    max_tokens_per_expert: int,
    active_ranks: Optional[Collection[int]] = None,
) -> RefExpertMajor:
    """Expert-major dispatch of every rank at once, from the sources' own inputs.

    token_selected_experts[s] ``[N_s, top_k]``, input_payloads[s][i]
    ``[N_s, *trail_i]`` (the user payloads), router_weights[s] ``[N_s, top_k]``
    or None. A pair (token ``t`` of rank ``s``, slot ``k``) whose id is a valid
    expert ``g`` of an active rank ``d`` (``s`` active too) is row ``i`` of
    ``d``'s local expert ``e = g - first_d``, where ``i`` counts the pairs of
    ``g`` before it in (source rank, token, slot) order; ``i >= M`` is dropped.
    """
    M = max_tokens_per_expert
    device = token_selected_experts[0].device
    active = set(range(ep_size)) if active_ranks is None else {int(r) for r in active_ranks}
    owner = _expert_owner(num_experts, ep_size, device)
    top_k = token_selected_experts[0].shape[1]
    ids = [t.detach().to(device).long() for t in token_selected_experts]
    weights = [(torch.ones(i.shape, dtype=torch.float32, device=device) if router_weights is None
                else router_weights[s].detach().to(device).float()) for s, i in enumerate(ids)]
    dest = []  # [s] int64 [N_s, top_k]: the pair's destination rank, -1 none
    for s, i in enumerate(ids):
        valid = (i >= 0) & (i < num_experts)
        d = torch.where(valid, owner[i.clamp(0, num_experts - 1)], -1)
        if s not in active:
            d = torch.full_like(d, -1)
        for r in range(ep_size):
            if r not in active:
                d = torch.where(d == r, -1, d)
        dest.append(d)
    position = [torch.full(i.shape, -1, dtype=torch.int64, device=device) for i in ids]
    templates = input_payloads[0] if input_payloads else []
    planes, counts, local_ids, plane_weights, dropped = [], [], [], [], []
    for d in range(ep_size):
        first, last = layout.expert_range(num_experts, ep_size, d)
        L = last - first
        # This rank's pairs in (s, t, k) order: row-major nonzero over each source in turn.
        found = [(s, (dest[s] == d).nonzero()) for s in range(ep_size)]
        experts = torch.cat([ids[s][tk[:, 0], tk[:, 1]] - first for s, tk in found]) if found else \
            torch.empty(0, dtype=torch.int64, device=device)
        order = torch.argsort(experts, stable=True)
        per_expert = torch.bincount(experts, minlength=L)
        starts = torch.cumsum(per_expert, 0) - per_expert
        pos = torch.empty_like(experts)
        pos[order] = torch.arange(experts.numel(), device=device) - starts[experts[order]]
        byte_planes = [torch.zeros((L, M, _bytes_per_row(p)), dtype=torch.uint8, device=device) for p in templates]
        rank_ids = torch.full((L, M), -1, dtype=torch.int32, device=device)
        rank_weights = torch.zeros((L, M), dtype=torch.float32, device=device)
        at = 0
        for s, tk in found:
            n = tk.shape[0]
            p = pos[at:at + n]
            e = experts[at:at + n]
            at += n
            position[s][tk[:, 0], tk[:, 1]] = p
            kept = p < M
            t, k, e, p = tk[kept, 0], tk[kept, 1], e[kept], p[kept]
            rank_ids[e, p] = e.to(torch.int32)
            rank_weights[e, p] = weights[s][t, k]
            for plane, payload in zip(byte_planes, input_payloads[s]):
                plane[e, p] = _row_bytes(payload.to(device))[t]
        planes.append([_from_row_bytes(plane, tp.dtype, (L, M, *tp.shape[1:])) for plane, tp in
                       zip(byte_planes, templates)])
        counts.append(per_expert.clamp(max=M).to(torch.int32))
        local_ids.append(rank_ids)
        plane_weights.append(rank_weights)
        dropped.append(int((per_expert - M).clamp(min=0).sum()))
    pair_dest, pair_row, pair_weight = [], [], []
    for s in range(ep_size):
        kept = (dest[s] >= 0) & (position[s] >= 0) & (position[s] < M)
        # Ascending (global expert, slot) is ascending (destination, local expert, slot): contiguous ranges.
        key = torch.where(kept, ids[s] * top_k + torch.arange(top_k, device=device), torch.iinfo(torch.int64).max)
        order = torch.argsort(key, dim=1, stable=True)
        kept = kept.gather(1, order)
        g = ids[s].gather(1, order)
        firsts = torch.tensor([layout.expert_range(num_experts, ep_size, r)[0] for r in range(ep_size)],
                              dtype=torch.int64, device=device)
        d = dest[s].gather(1, order)
        local = g - firsts[d.clamp(min=0)]
        row = local * M + position[s].gather(1, order)
        pair_dest.append(torch.where(kept, d, -1))
        pair_row.append(torch.where(kept, row, -1))
        pair_weight.append(torch.where(kept, weights[s].gather(1, order), 0.0))
    return RefExpertMajor(planes, counts, local_ids, plane_weights, dropped, pair_dest, pair_row, pair_weight, M)


def reference_combine_expert_major(
    expert_outputs: list[Tensor],
    ref: RefExpertMajor,
    output_dtype: Optional[torch.dtype] = None,
) -> list[Tensor]:
    """Expert-major combine of every rank at once.

    expert_outputs[d]: ``[L_d, M, *trail]`` rank ``d``'s expert outputs (only
    the rows of kept pairs are read). Returns per source rank ``s`` a new
    ``[N_s, *trail]`` tensor of ``output_dtype`` (default the outputs'): from
    fp32 zeros, for each kept pair in the combine's order, ``acc = acc + w *
    row`` in fp32 (the product rounded before the add), then cast once.
    """
    device = expert_outputs[0].device
    outputs = [e.detach().to(device) for e in expert_outputs]
    dtype = outputs[0].dtype if output_dtype is None else output_dtype
    trail = tuple(outputs[0].shape[2:])
    flat = [o.reshape(o.shape[0] * o.shape[1], *trail) for o in outputs]
    results = []
    for dest, row, weight in zip(ref.pair_dest, ref.pair_row, ref.pair_weight):
        dest, row, weight = dest.to(device), row.to(device), weight.to(device)
        acc = torch.zeros((dest.shape[0], *trail), dtype=torch.float32, device=device)
        for q in range(dest.shape[1]):  # each token's q-th pair: the sum stays in order per token
            for d in range(len(outputs)):
                sel = (dest[:, q] == d).nonzero().squeeze(1)
                if sel.numel() == 0:
                    continue
                x = flat[d][row[sel, q]].float()
                w = weight[sel, q].view(-1, *([1] * len(trail)))
                acc[sel] = acc[sel] + w * x
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


# ---------------------------------------------------------------------------
# Number formats, from their specifications (OCP Microscaling Formats v1.0,
# NVFP4): the oracle of the low-precision combine and the quantized outputs.
# The scale recipes are the kernels' (csrc/quantize.h): FlashInfer's.
# ---------------------------------------------------------------------------

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_QUANT_BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}


def e4m3_codes(x: Tensor) -> Tensor:
    """float8_e4m3fn of fp32 ``x``: round to nearest even, saturating at +-448; NaN -> 0x7F."""
    x = x.float()
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.where(x.isnan(), torch.full_like(codes.view(torch.uint8), 0x7F), codes.view(torch.uint8)).view(
        torch.float8_e4m3fn)


def e2m1_codes(x: Tensor) -> Tensor:
    """uint8 e2m1 codes (sign << 3 | magnitude index) of fp32 ``x``: nearest of
    0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even index, saturating; NaN -> +-6."""
    x = x.float()
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float64, device=x.device)
    dist = (x.abs().double().unsqueeze(-1) - table).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    even = torch.arange(8, device=x.device) % 2 == 0
    # A tie has two nearest neighbours, one of them even: take it.
    pick = torch.where((nearest & even).any(dim=-1), (nearest & even).int().argmax(dim=-1),
                       nearest.int().argmax(dim=-1))
    pick = torch.where(x.isnan() | x.isinf(), 7, pick)
    sign = (torch.signbit(x)).to(torch.uint8) << 3
    return pick.to(torch.uint8) | sign


def e2m1_values(codes: Tensor) -> Tensor:
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    v = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -v, v)


def ue8m0_round_up(s: Tensor) -> Tensor:
    """int64 ue8m0 codes: the smallest power of two 2^(code - 127) >= s (s >= 0),
    saturating at 2^127; NaN -> 255."""
    mantissa, exponent = torch.frexp(s.double())  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
    log2_up = torch.where(mantissa == 0.5, exponent - 1, exponent).long()
    codes = (log2_up + 127).clamp(0, 254)
    codes = torch.where(s == 0, 0, codes)
    codes = torch.where(s.isinf(), 254, codes)
    return torch.where(s.isnan(), 255, codes)


def pow2(biased: Tensor) -> Tensor:
    """fp32 2^(biased - 127) for biased in [0, 254] (bit patterns, so exact)."""
    bits = torch.where(biased == 0, 0x00400000, biased.long() << 23).to(torch.int32)
    return bits.view(torch.float32)


def _block_amax(blocks: Tensor) -> Tensor:
    # A NaN element does not count towards its block's maximum (as fmaxf).
    a = blocks.abs()
    return torch.where(a.isnan(), 0.0, a).amax(dim=-1)


def low_precision_values(rows: Tensor, *, block_scaled: bool = False) -> Tensor:
    """fp32 values a low-precision combine takes from ``rows`` (``[..., H]`` or
    any trailing shape, flattened per row: ``[ep_size, T, *trail]``): each
    element rounded to e4m3; block-scaled, each block of
    ``layout.LOW_PRECISION_BLOCK`` elements of a row first multiplied by
    2^(127 - code), code = ue8m0_round_up(amax * fp32(1/448)), and the e4m3
    value multiplied back by 2^(code - 127)."""
    x = rows.float()
    if not block_scaled:
        return e4m3_codes(x).float()
    lead, n = x.shape[:2], x[0, 0].numel() if x.dim() > 2 else 1
    flat = x.reshape(*lead, n)
    block = layout.LOW_PRECISION_BLOCK
    out = torch.empty_like(flat)
    for first in range(0, n, block):
        part = flat[..., first:first + block]
        amax = _block_amax(part)
        codes = ue8m0_round_up(amax * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))
        inverse, scale = pow2(254 - codes).unsqueeze(-1), pow2(codes).unsqueeze(-1)
        out[..., first:first + block] = e4m3_codes(part * inverse).float() * scale
    return out.reshape(x.shape)


def scale_layout_extent(sf_layout: int, rows: int, cols: int) -> int:
    """Number of scales of ``sf_layout`` (0: 128x4, 1: 8x4, 2: linear) for rows x cols, padding included."""
    if sf_layout == 2:
        return rows * cols
    tile = 128 if sf_layout == 0 else 8
    return -(-rows // tile) * tile * (-(-cols // 4) * 4)


def swizzle_scales(scales: Tensor, sf_layout: int) -> Tensor:
    """``[rows, cols]`` scales laid out flat in ``sf_layout``, padding zero.
    128x4: tiles of 128 rows x 4 columns in row-major tile order; a tile holds
    its 32 x 4 x 4 entries as [row % 32][row // 32 % 4][column % 4]. 8x4:
    tiles of 8 x 4 in row-major order, row-major inside."""
    dtype = scales.dtype
    if dtype == torch.float8_e4m3fn:
        scales = scales.view(torch.uint8)
    rows, cols = scales.shape
    if sf_layout == 2:
        return scales.reshape(-1).clone().view(dtype)
    tile = 128 if sf_layout == 0 else 8
    padded = torch.zeros((-(-rows // tile) * tile, -(-cols // 4) * 4), dtype=scales.dtype, device=scales.device)
    padded[:rows, :cols] = scales
    r, c = padded.shape
    if sf_layout == 0:
        tiles = padded.reshape(r // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4)
    else:
        tiles = padded.reshape(r // 8, 8, c // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1).view(dtype)


def reference_quantize(x: Tensor, fmt: str, sf_layout: int = 2, global_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Quantize ``[rows, H]`` (already rounded to the payload dtype) as the
    combine's quantized outputs: ``fmt`` "mxfp8" (float8_e4m3fn ``[rows, H]``,
    uint8 ue8m0 scales per 32), "mxfp4" (uint8 ``[rows, H // 2]`` e2m1 pairs,
    the even element in the low nibble; ue8m0 per 32) or "nvfp4" (likewise,
    float8_e4m3fn scales per 16 and ``global_scale``). Returns (data, flat
    scales in ``sf_layout``).

    Scales: MX: ue8m0_round_up(amax * fp32(1/max)), max 448 (e4m3) or 6
    (e2m1), elements multiplied by 2^(127 - code). NVFP4: s = e4m3(g * (amax
    * fp32(1/6))), elements multiplied by 1 / (s * (1 / g)) (0 when amax or
    s is 0). All in fp32 with IEEE rounding."""
    block = _QUANT_BLOCK[fmt]
    v = x.float()
    rows, h = v.shape
    blocks = v.reshape(rows, h // block, block)
    amax = _block_amax(blocks)
    if fmt == "nvfp4":
        g = torch.tensor(global_scale, dtype=torch.float32)
        codes = e4m3_codes(g * (amax * torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)))
        decoded = codes.float()
        one = torch.tensor(1.0, dtype=torch.float32)
        inverse = torch.where((amax != 0) & (decoded != 0), one / (decoded * (one / g)), 0.0)
        scales = codes
    else:
        inv_max = torch.tensor(1.0 / (E4M3_MAX if fmt == "mxfp8" else E2M1_MAX), dtype=torch.float32)
        ue8m0 = ue8m0_round_up(amax * inv_max)
        inverse = torch.where(ue8m0 == 255, float("nan"), pow2((254 - ue8m0).clamp(0, 254)))
        scales = ue8m0.to(torch.uint8)
    scaled = (blocks * inverse.unsqueeze(-1)).reshape(rows, h)
    if fmt == "mxfp8":
        data = e4m3_codes(scaled)
    else:
        c = e2m1_codes(scaled)
        data = c[:, 0::2] | (c[:, 1::2] << 4)
    return data, swizzle_scales(scales, sf_layout)


def dequantize(data: Tensor, scales: Tensor, fmt: str, h: int, sf_layout: int = 2,
               global_scale: float = 1.0) -> Tensor:
    """fp32 ``[rows, h]`` values of a quantized output (for error measurements)."""
    block = _QUANT_BLOCK[fmt]
    rows, cols = data.shape[0], h // block
    # Where each (row, block)'s scale lies in the layout: 1 + its index, swizzled.
    index = torch.arange(1, rows * cols + 1, dtype=torch.int64).reshape(rows, cols)
    placed = swizzle_scales(index, sf_layout)
    position = torch.empty(rows * cols, dtype=torch.int64)
    where = placed.nonzero().squeeze(1)
    position[placed[where] - 1] = where
    flat = scales.reshape(-1).cpu()[position]
    if fmt == "nvfp4":
        s = flat.float() / global_scale
    else:
        s = pow2(flat.view(torch.uint8).long().clamp(0, 254))
    s = s.reshape(rows, cols, 1)
    data = data.cpu()
    if fmt == "mxfp8":
        values = data.float().reshape(rows, cols, block)
    else:
        codes = torch.stack([data & 15, data >> 4], dim=-1).reshape(rows, h)
        values = e2m1_values(codes).reshape(rows, cols, block)
    return (values * s).reshape(rows, h)
