"""FlashInfer's ``Mapping``: where a rank sits in a job's tensor, pipeline,
context and MoE parallel groups (docs/DESIGN.md section 2).

The constructor takes FlashInfer's arguments with FlashInfer's defaults and
derivations, so ``Mapping(world_size=8, rank=r, tp_size=8, moe_ep_size=8)``
means here what it means there. :class:`~torch_moe_a2a.MoeAlltoAll` reads
``moe_ep_rank`` and ``moe_ep_size`` (and, to pick this rank's EP group out of
a larger communicator, the ranks :func:`ep_group_color` uses); it accepts
FlashInfer's own ``Mapping`` as well.

Rank order, as in FlashInfer: ``rank = (pp_rank * cp_size + cp_rank) * tp_size
+ tp_rank``, and inside the tensor-parallel group ``tp_rank = (moe_tp_rank *
moe_cluster_size + moe_cluster_rank) * moe_ep_size + moe_ep_rank``.
"""

from __future__ import annotations

from typing import Any, Optional

# FlashInfer's "not given" value of the MoE and attention sizes.
_UNSET = -1
# The constructor arguments, in FlashInfer's to_dict order.
_FIELDS = ("world_size", "rank", "gpus_per_node", "cp_size", "tp_size", "pp_size", "moe_tp_size",
           "moe_cluster_size", "moe_ep_size", "attn_tp_size", "attn_cp_size", "auto_parallel")


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Mapping: {name} must be a positive int, got {value!r}")
    return value


def _non_negative(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Mapping: {name} must be a non-negative int, got {value!r}")
    return value


def _unset(value: Any) -> bool:
    """Whether ``value`` is the "not given" -1 itself (-1.0 compares equal and is no int)."""
    return type(value) is int and value == _UNSET


def _quotient(what: str, total: int, divisor: int, hint: str = "") -> int:
    if total % divisor:
        raise ValueError(f"Mapping: {what}: {total} is not divisible by {divisor}{hint}")
    return total // divisor


class Mapping:
    """A rank's place in the parallel layout, with FlashInfer's constructor.

    Args:
        world_size: ranks in the job; must equal ``tp_size * pp_size * cp_size``
            (unless ``auto_parallel``).
        rank: this rank, in ``[0, world_size)``.
        gpus_per_node: GPUs per node (``node_rank``, ``local_rank``). 0 is
            accepted, as FlashInfer does: SGLang and vLLM pass
            ``torch.cuda.device_count()``, 0 on a host without a GPU; the
            node and local ranks then raise.
        cp_size, tp_size, pp_size: context, tensor and pipeline parallel sizes.
        moe_cluster_size, moe_tp_size, moe_ep_size: how each tensor-parallel
            group splits for the MoE layers; ``-1`` (not given) is derived as in
            FlashInfer: none given means ``moe_ep_size = 1``, ``moe_tp_size =
            tp_size``; one of ``moe_tp_size`` / ``moe_ep_size`` given derives the
            other from ``tp_size``. Their product must equal ``tp_size``.
        attn_tp_size, attn_cp_size: attention parallel sizes (``attn_cp_size``
            must be 1).
        cp_config: carried, not interpreted.
        auto_parallel: every size must be 1; the ranks derived are 0.
        enable_attention_dp: carried (FlashInfer then skips the rank check).

    Raises:
        ValueError: sizes that are not positive ints (-1 is "not given";
            -1.0 or a bool is refused; gpus_per_node may be 0), do not
            divide, or do not multiply up
            as above; a rank that is not an int (or a bool), or outside
            ``[0, world_size)``.
        NotImplementedError: ``moe_ep_size > 1`` with ``cp_size > 1`` (as in FlashInfer).
    """

    def __init__(
        self,
        world_size: int = 1,
        rank: int = 0,
        gpus_per_node: int = 8,
        *,
        cp_size: int = 1,
        cp_config: Optional[dict] = None,
        tp_size: int = 1,
        pp_size: int = 1,
        moe_cluster_size: int = _UNSET,
        moe_tp_size: int = _UNSET,
        moe_ep_size: int = _UNSET,
        attn_tp_size: int = _UNSET,
        attn_cp_size: int = _UNSET,
        auto_parallel: bool = False,
        enable_attention_dp: bool = False,
    ):
        for name, value in (("world_size", world_size), ("cp_size", cp_size), ("tp_size", tp_size),
                            ("pp_size", pp_size)):
            _positive(name, value)
        _non_negative("gpus_per_node", gpus_per_node)
        if _unset(moe_cluster_size):
            moe_cluster_size = 1
        _positive("moe_cluster_size", moe_cluster_size)
        if _unset(moe_tp_size) and _unset(moe_ep_size):
            moe_tp_size = _quotient("tp_size / moe_cluster_size", tp_size, moe_cluster_size)
            moe_ep_size = 1
        elif _unset(moe_tp_size):
            # FlashInfer's layout: the MoE groups split the tensor-parallel group, so an
            # expert-parallel job of N ranks is tp_size=N, moe_ep_size=N.
            moe_tp_size = _quotient("tp_size / (moe_ep_size * moe_cluster_size)", tp_size,
                                    _positive("moe_ep_size", moe_ep_size) * moe_cluster_size,
                                    f" (the MoE groups split the tensor-parallel group: for expert parallelism "
                                    f"over {moe_ep_size * moe_cluster_size} ranks pass "
                                    f"tp_size={moe_ep_size * moe_cluster_size} or a multiple of it)")
        elif _unset(moe_ep_size):
            moe_ep_size = _quotient("tp_size / (moe_tp_size * moe_cluster_size)", tp_size,
                                    _positive("moe_tp_size", moe_tp_size) * moe_cluster_size)
        _positive("moe_tp_size", moe_tp_size)
        _positive("moe_ep_size", moe_ep_size)
        if _unset(attn_tp_size) and _unset(attn_cp_size):
            attn_tp_size, attn_cp_size = tp_size * cp_size, 1
        elif _unset(attn_tp_size):
            attn_tp_size = _quotient("cp_size * tp_size / attn_cp_size", cp_size * tp_size,
                                     _positive("attn_cp_size", attn_cp_size))
        elif _unset(attn_cp_size):
            attn_cp_size = _quotient("cp_size * tp_size / attn_tp_size", cp_size * tp_size,
                                     _positive("attn_tp_size", attn_tp_size))
        if attn_cp_size != 1:
            raise ValueError(f"Mapping: attn_cp_size must be 1, got {attn_cp_size} (attn_tp_size {attn_tp_size})")
        if auto_parallel:
            if tp_size != 1 or pp_size != 1 or cp_size != 1:
                # "auto parallel" as FlashInfer's message words it (its tests match on it).
                raise ValueError("Mapping: when auto parallel is enabled (auto_parallel=True), tp_size, pp_size "
                                 f"and cp_size must be 1, got {tp_size}, {pp_size}, {cp_size}")
        elif tp_size * pp_size * cp_size != world_size:
            raise ValueError(f"Mapping: world_size {world_size} must equal tp_size * pp_size * cp_size = "
                             f"{tp_size} * {pp_size} * {cp_size}")
        if moe_tp_size * moe_ep_size * moe_cluster_size != tp_size:
            raise ValueError(f"Mapping: tp_size {tp_size} must equal moe_tp_size * moe_ep_size * moe_cluster_size "
                             f"= {moe_tp_size} * {moe_ep_size} * {moe_cluster_size}")
        if attn_tp_size * attn_cp_size != tp_size * cp_size:
            raise ValueError(f"Mapping: tp_size * cp_size = {tp_size} * {cp_size} must equal attn_tp_size * "
                             f"attn_cp_size = {attn_tp_size} * {attn_cp_size}")
        if moe_ep_size != 1 and cp_size > 1:
            raise NotImplementedError("Mapping: context parallelism (cp_size > 1) with MoE expert parallelism")
        if moe_cluster_size > 1 and moe_ep_size != 1:
            raise ValueError(f"Mapping: moe_cluster_size {moe_cluster_size} > 1 needs moe_ep_size 1, "
                             f"got {moe_ep_size}")

        self.world_size = world_size
        self.enable_attention_dp = enable_attention_dp
        self.rank = rank  # checked by the setter
        self.gpus_per_node = gpus_per_node
        self.cp_size = cp_size
        self.cp_config = {} if cp_config is None else cp_config
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.moe_cluster_size = moe_cluster_size
        self.moe_tp_size = moe_tp_size
        self.moe_ep_size = moe_ep_size
        self.attn_tp_size = attn_tp_size
        self.attn_cp_size = attn_cp_size
        self.auto_parallel = auto_parallel
        self._build_groups()

    def _build_groups(self) -> None:
        """Every group's global ranks, as FlashInfer's constructor lists them
        (``tp_groups``, ``pp_groups``, ...); the ``*_group`` properties pick
        this rank's. They depend on the sizes only, not on ``rank``."""
        tp, cp, pp, world = self.tp_size, self.cp_size, self.pp_size, self.world_size
        ep, cluster, moe_tp = self.moe_ep_size, self.moe_cluster_size, self.moe_tp_size
        moe_span = moe_tp * ep * cluster  # == tp_size
        self.pp_groups = [list(range(i, world, tp * cp)) for i in range(tp * cp)]
        self.cp_groups = [list(range(i * tp * cp + j, (i + 1) * tp * cp + j, tp)) for i in range(pp) for j in range(tp)]
        self.tp_groups = [list(range(i * tp * cp + j * tp, i * tp * cp + (j + 1) * tp))
                          for i in range(pp) for j in range(cp)]
        self.moe_tp_groups = [list(range(i * moe_span + j, (i + 1) * moe_span, cluster * ep))
                              for i in range(pp) for j in range(cluster * ep)]
        self.moe_cluster_groups = [list(range(i * moe_span + j * cluster * ep, i * moe_span + (j + 1) * cluster * ep))
                                   for i in range(pp) for j in range(moe_tp)]
        self.moe_ep_groups = [list(range(i * moe_span + j * cluster * ep + k * ep,
                                         i * moe_span + j * cluster * ep + (k + 1) * ep))
                              for i in range(pp) for j in range(moe_tp) for k in range(cluster)]

    @property
    def rank(self) -> int:
        """This rank, in ``[0, world_size)``; assigning it checks it as the constructor does."""
        return self._rank

    @rank.setter
    def rank(self, rank: int) -> None:
        # FlashInfer checks an assigned rank as the constructor's (a wrong one
        # raises and leaves the mapping unchanged). enable_attention_dp skips
        # the range check, not the type's: the ranks derived from a float
        # (moe_ep_rank, ...) would be floats.
        if not isinstance(rank, int) or isinstance(rank, bool) or not (
                self.enable_attention_dp or 0 <= rank < self.world_size):
            if self.enable_attention_dp:
                raise ValueError(f"Mapping: rank must be an int, got {rank!r}")
            # FlashInfer's words in parentheses: its tests match on them.
            raise ValueError(f"Mapping: rank must be an int in [0, {self.world_size}), got {rank!r} (Rank should "
                             f"be an integer between 0 and {self.world_size - 1})")
        self._rank = rank

    # ---- ranks inside the groups (FlashInfer's derivations) ----

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group (0 with ``auto_parallel``)."""
        return 0 if self.auto_parallel else self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 with ``auto_parallel``)."""
        return 0 if self.auto_parallel else self.rank // (self.tp_size * self.cp_size)

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group (0 with ``auto_parallel``)."""
        return 0 if self.auto_parallel else self.rank % (self.tp_size * self.cp_size) // self.tp_size

    @property
    def moe_tp_rank(self) -> int:
        """This rank's MoE tensor-parallel rank, ``tp_rank // (moe_ep_size * moe_cluster_size)``."""
        return self.tp_rank // (self.moe_ep_size * self.moe_cluster_size)

    @property
    def moe_cluster_rank(self) -> int:
        """This rank's place in its MoE cluster, ``tp_rank % moe_cluster_size``."""
        return self.tp_rank % self.moe_cluster_size

    @property
    def moe_ep_rank(self) -> int:
        """This rank's place in its MoE expert-parallel group, ``tp_rank % moe_ep_size`` (MoeAlltoAll's ep_rank)."""
        return self.tp_rank % self.moe_ep_size

    @property
    def node_rank(self) -> int:
        """The node this rank runs on, ``rank // gpus_per_node``."""
        return self.get_node_rank(self.rank)

    @property
    def local_rank(self) -> int:
        """This rank's GPU on its node, ``rank % gpus_per_node``."""
        return self.get_local_rank(self.rank)

    def _gpus_per_node(self, what: str) -> int:
        if self.gpus_per_node == 0:
            raise ValueError(f"Mapping: no {what} with gpus_per_node 0 (torch.cuda.device_count() on a host "
                             f"without a GPU); pass the GPUs of a node")
        return self.gpus_per_node

    # ---- this rank's groups (FlashInfer's indexing of the lists _build_groups makes) ----

    @property
    def tp_group(self) -> list[int]:
        """The global ranks of this rank's tensor-parallel group."""
        return self.tp_groups[self.pp_rank * self.cp_size + self.cp_rank]

    @property
    def pp_group(self) -> list[int]:
        """The global ranks of this rank's pipeline-parallel group."""
        return self.pp_groups[self.cp_rank * self.tp_size + self.tp_rank]

    @property
    def cp_group(self) -> list[int]:
        """The global ranks of this rank's context-parallel group."""
        return self.cp_groups[self.pp_rank * self.tp_size + self.tp_rank]

    @property
    def moe_tp_group(self) -> list[int]:
        """The global ranks of this rank's MoE tensor-parallel group."""
        return self.moe_tp_groups[self.pp_rank * self.moe_cluster_size * self.moe_ep_size
                                  + self.moe_cluster_rank * self.moe_ep_size + self.moe_ep_rank]

    @property
    def moe_cluster_group(self) -> list[int]:
        """The global ranks of this rank's MoE cluster."""
        return self.moe_cluster_groups[self.pp_rank * self.moe_tp_size + self.moe_tp_rank]

    @property
    def moe_ep_group(self) -> list[int]:
        """The global ranks of this rank's MoE expert-parallel group, in ``moe_ep_rank`` order."""
        return self.moe_ep_groups[self.pp_rank * self.moe_tp_size * self.moe_cluster_size
                                  + self.moe_tp_rank * self.moe_cluster_size + self.moe_cluster_rank]

    # ---- FlashInfer's predicates and helpers ----

    def get_node_rank(self, rank: int) -> int:
        return rank // self._gpus_per_node("node rank")

    def get_local_rank(self, rank: int) -> int:
        return rank % self._gpus_per_node("local rank")

    def has_tp(self) -> bool:
        return self.tp_size > 1

    def has_pp(self) -> bool:
        return self.pp_size > 1

    def has_cp(self) -> bool:
        return self.cp_size > 1

    def has_moe_cluster(self) -> bool:
        return self.moe_cluster_size > 1

    def has_moe_tp(self) -> bool:
        return self.moe_tp_size > 1

    def has_moe_ep(self) -> bool:
        """Whether the MoE layers are expert-parallel: ``moe_ep_size > 1``."""
        return self.moe_ep_size > 1

    def is_multi_node(self) -> bool:
        """Whether the job spans more than one node: ``world_size > gpus_per_node``."""
        return self.world_size > self.gpus_per_node

    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def is_second_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 2

    def prev_pp_rank(self) -> int:
        """The global rank of the previous pipeline stage's peer (wrapping around)."""
        return (self.rank - self.tp_size * self.cp_size) % self.world_size

    def next_pp_rank(self) -> int:
        """The global rank of the next pipeline stage's peer (wrapping around)."""
        return (self.rank + self.tp_size * self.cp_size) % self.world_size

    def pp_layers(self, num_layers: int) -> list[int]:
        """This stage's layers; with ``num_layers % pp_size = n``, the first n stages hold one more."""
        import torch

        return torch.tensor_split(torch.arange(num_layers), self.pp_size)[self.pp_rank].tolist()

    def ep_experts(self, num_experts: int) -> list[int]:
        """The experts of this rank's MoE expert-parallel slot, ``num_experts // moe_ep_size`` in a row.

        Raises:
            ValueError: ``cp_size`` not 1 (as FlashInfer asserts); ``num_experts``
                not a multiple of ``moe_ep_size``: FlashInfer's split leaves the
                remainder out, while the dispatch routes it to the first ranks
                (:func:`~torch_moe_a2a.local_expert_range` gives those).
        """
        if self.cp_size != 1:  # FlashInfer asserts it
            raise ValueError(f"Mapping.ep_experts: needs cp_size 1, got {self.cp_size}")
        if num_experts % self.moe_ep_size:
            raise ValueError(f"Mapping.ep_experts: num_experts {num_experts} is not a multiple of moe_ep_size "
                             f"{self.moe_ep_size}: FlashInfer's split would leave experts out, and the dispatch "
                             f"gives the first {num_experts % self.moe_ep_size} ranks one more; "
                             f"torch_moe_a2a.local_expert_range(num_experts, ep_size, ep_rank) gives a rank's experts")
        per_rank = num_experts // self.moe_ep_size
        return list(range(self.moe_ep_rank * per_rank, (self.moe_ep_rank + 1) * per_rank))

    # ---- value semantics ----

    def to_dict(self) -> dict:
        """The constructor arguments by name, in FlashInfer's order, without ``cp_config`` and ``enable_attention_dp``.

        Equality and hashing compare these.

        Returns:
            A new dict; :meth:`from_dict` of it gives an equal Mapping (unless ``rank`` lies outside
            ``[0, world_size)``, which only ``enable_attention_dp`` allows).
        """
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, values: dict) -> "Mapping":
        """The :class:`Mapping` of constructor arguments by name, such as :meth:`to_dict` returns.

        Raises:
            ValueError, NotImplementedError: what the constructor raises for these values.
            TypeError: a key that is not a constructor argument.
        """
        return cls(**values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.to_dict().values()))

    def __repr__(self) -> str:
        return "Mapping(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"


def ep_group_color(mapping: Any) -> tuple[int, int]:
    """``(color, key)`` that split a job-wide communicator into MoE EP groups:
    ranks with equal ``color`` form one group, ordered by ``key`` =
    ``moe_ep_rank``. Works on FlashInfer's ``Mapping`` too; an object with only
    ``moe_ep_rank`` / ``moe_ep_size`` is one EP group (color 0)."""
    ep_rank = int(mapping.moe_ep_rank)
    try:
        pp_rank, cp_rank, cp_size = int(mapping.pp_rank), int(mapping.cp_rank), int(mapping.cp_size)
        moe_tp_rank, moe_tp_size = int(mapping.moe_tp_rank), int(mapping.moe_tp_size)
        cluster_rank, cluster_size = int(mapping.moe_cluster_rank), int(mapping.moe_cluster_size)
    except AttributeError:
        return 0, ep_rank
    color = ((pp_rank * cp_size + cp_rank) * moe_tp_size + moe_tp_rank) * cluster_size + cluster_rank
    return color, ep_rank
