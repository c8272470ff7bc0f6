"""Simulated expert parallelism: ``ep_size`` ranks inside one process on one device.

Used by the demo, the benchmark and the tests. All ranks share one workspace
(a plain zeroed tensor, DESIGN.md section 5) and run concurrently, because a
dispatch or combine waits for its peers:

- CPU: a thread per rank. The ops release the GIL while they copy and wait,
  and their waits back off (yield, then sleep), so many ranks share few cores.
- CUDA: a stream per rank. The host calls every rank's work in rank order,
  each inside its own stream; the kernels of different streams then run
  concurrently on the device and wait for each other there.

CUDA graphs of simulated ranks: one graph per rank (:meth:`SimulatedEP.capture`),
each captured on and replayed on its rank's stream, as a rank of a real
deployment captures its own. Not one graph with a branch per rank: CUDA does
not promise that the branches of one graph run concurrently, and a rank's
kernel that waits for a peer's deadlocks (until the timeout) where the driver
runs the peer's branch after it. Seen on an H200 after a process had captured
and freed the graphs of eight other shapes (docs/performance.md, 'Design
decisions and their measured effect').
"""

from __future__ import annotations

import functools
import signal
import threading
from typing import Any, Callable, Optional, TypeVar

import torch

from . import _C
from .api import (
    moe_a2a_combine,
    moe_a2a_dispatch,
    moe_a2a_get_recv_counts,
    moe_a2a_get_workspace_size_per_rank,
    moe_a2a_initialize,
)
from .fastpath import expect_ints
from .metainfo import check_timeout, reinitialize_row
from .workspace import allocate_workspace, check_device_visible

T = TypeVar("T")

# Keyword arguments of dispatch/combine that may be given per rank, as a list
# or tuple indexed by rank (the others are shared by all ranks).
_PER_RANK_KWARGS = frozenset({"eplb_local_stats", "active_rank_mask", "output", "output_scales", "enable_pdl"})


# Simulated ranks on one GPU spin on their own streams at once; a GPU runs at
# most this many streams concurrently (CUDA_DEVICE_MAX_CONNECTIONS hardware work
# queues, at most 32): a rank beyond it would queue behind a spinning peer.
MAX_SIMULATED_RANKS_PER_GPU = 32


class SimulatedEP:
    """``ep_size`` simulated ranks sharing one workspace on ``device``.

    ``workspace``: ``[ep_size, size_per_rank]`` uint8, owned by this object.
    ``metainfo[r]``: rank ``r``'s metainfo. Every row is initialized before
    any rank runs.

    Args:
        ep_size: the number of ranks.
        max_num_tokens: the most tokens a rank dispatches in one call.
        dispatch_bytes_per_token, combine_bytes_per_token: the bytes per
            token of the dispatch's payloads (all of them: hidden states, ids,
            router weights) and of the combine's, which size the workspace:
            ``moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens,
            dispatch_bytes_per_token, combine_bytes_per_token,
            eplb_stats_num_experts)``. Required unless
            ``workspace_size_per_rank`` is given (then unused).
        eplb_stats_num_experts: as for :func:`moe_a2a_initialize`.
        device: where the workspace lives (``"cpu"``: a thread per rank;
            a CUDA device: a stream per rank).
        timeout_s: the bound on every wait for a peer (None:
            MOE_A2A_TIMEOUT_S, else 30 s). It is the metainfo's
            (``moe_a2a_initialize(timeout_s=)``), so it bounds the calls that
            pass ``metainfo[r]`` to the functional API directly too.
        workspace_size_per_rank: the row size in bytes, in place of the
            bytes per token (an expert-major size, say, from
            ``moe_a2a_get_workspace_size_per_rank_expert_major``).

    Raises:
        ValueError: ``ep_size``, ``max_num_tokens``, the bytes per token,
            ``eplb_stats_num_experts`` or ``workspace_size_per_rank`` not an
            int (a bool or a float), or out of the ops' ranges; neither
            ``workspace_size_per_rank`` nor both bytes per token; ``timeout_s``
            not None or a positive number of seconds up to
            ``layout.MAX_TIMEOUT_S`` (as ``moe_a2a_initialize`` and
            :class:`MoeAlltoAll` check it); more than
            ``MAX_SIMULATED_RANKS_PER_GPU`` ranks on a GPU. Checked before the
            workspace is allocated.
        RuntimeError: a CUDA device where torch sees none.
    """

    def __init__(
        self,
        ep_size: int,
        max_num_tokens: int,
        *,
        dispatch_bytes_per_token: Optional[int] = None,
        combine_bytes_per_token: Optional[int] = None,
        eplb_stats_num_experts: int = 0,
        device: Any = "cpu",
        timeout_s: Optional[float] = None,
        workspace_size_per_rank: Optional[int] = None,
    ):
        fn = "SimulatedEP"
        sizes = dict(dispatch_bytes_per_token=dispatch_bytes_per_token, combine_bytes_per_token=combine_bytes_per_token,
                     workspace_size_per_rank=workspace_size_per_rank)
        expect_ints(fn, ep_size=ep_size, max_num_tokens=max_num_tokens, eplb_stats_num_experts=eplb_stats_num_experts,
                    **{name: value for name, value in sizes.items() if value is not None})
        if workspace_size_per_rank is None and (dispatch_bytes_per_token is None or combine_bytes_per_token is None):
            raise ValueError(f"{fn}: dispatch_bytes_per_token and combine_bytes_per_token size the workspace; give "
                             "both, or workspace_size_per_rank")
        check_timeout(timeout_s, fn)  # moe_a2a_initialize's and MoeAlltoAll's check
        self.ep_size = ep_size
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        check_device_visible(fn, self.device, "; simulate the ranks on device='cpu'")
        if self.device.type == "cuda" and ep_size > MAX_SIMULATED_RANKS_PER_GPU:
            raise ValueError(
                f"simulated EP on one GPU supports at most {MAX_SIMULATED_RANKS_PER_GPU} ranks (the GPU's "
                f"concurrent hardware queues), got ep_size {ep_size}; simulate on the CPU or run one process per rank"
            )
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        size_per_rank = workspace_size_per_rank
        if size_per_rank is None:
            size_per_rank = moe_a2a_get_workspace_size_per_rank(
                ep_size, max_num_tokens, dispatch_bytes_per_token, combine_bytes_per_token, eplb_stats_num_experts
            )
        self.workspace = allocate_workspace(size_per_rank, ep_size=ep_size, device=self.device)
        self.metainfo = [
            moe_a2a_initialize(self.workspace, rank, ep_size, max_num_tokens, eplb_stats_num_experts,
                               timeout_s=self.timeout_s)
            for rank in range(ep_size)
        ]
        self.streams = (
            [torch.cuda.Stream(self.device) for _ in range(ep_size)] if self.device.type == "cuda" else None
        )

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """Call ``fn(rank)`` for every rank concurrently and return the results in rank order.

        CPU: one thread per rank, in the caller's grad and inference modes
        (``torch.no_grad()`` around ``run`` holds in every rank's ``fn``; other
        per-thread state, such as autocast, is not carried over).
        CUDA: ``fn(rank)`` runs on the host in rank
        order inside ``torch.cuda.stream(self.streams[rank])``; each stream
        first waits for the current stream, and the current stream waits for
        all of them afterwards, so the results are ordered like ordinary work.
        There ``fn`` must not wait on the host for the device (``.item()``, a
        copy from pageable host memory such as ``cpu_tensor.to("cuda")``):
        the ranks after it are not issued yet, so such a wait in rank 1 ends
        only once rank 0's exchange has timed out waiting for rank 1. Nor may
        it launch a kernel for the first time in the process (a torch op of
        a dtype or layout not run before): a kernel's first launch waits for
        every stream's queued work, rank 0's waiting exchange included, on
        the device (on the host under ``CUDA_MODULE_LOADING=LAZY``; seen with
        torch 2.11 and CUDA 13). Run such a step once before, on a one-rank
        ``SimulatedEP``: the library's ops launch the same kernels there (its
        planes have the same alignments).
        If a rank raises, the others still run to completion (their waits for
        it end within milliseconds where its failure was recorded, at the
        timeout where it was refused on the host) and then the first exception
        raised is re-raised.
        CPU: interrupted in the main thread (Ctrl-C), it records the
        interruption in every row of the workspace, which ends every rank's
        wait within milliseconds, waits for the ranks' ``fn`` to return and
        re-raises; the workspace then stays failed until :meth:`reset`.

        Args:
            fn: called once per rank with the rank (an int in ``[0, ep_size)``).

        Returns:
            ``[fn(0), ..., fn(ep_size - 1)]``.

        Raises:
            BaseException: the first exception a rank's ``fn`` raised (in the
                order they were raised), after every rank finished.
            KeyboardInterrupt: the main thread's, after every rank finished
                (CPU, as above).
        """
        results: list[Any] = [None] * self.ep_size
        errors: list[BaseException] = []  # in the order they were raised
        lock = threading.Lock()

        # Set when a rank's fn has returned: after an interrupted join, Thread.join
        # may return while the thread still runs (CPython 3.11's join marks a
        # thread stopped when a signal handler raised inside it).
        finished = [threading.Event() for _ in range(self.ep_size)]
        # The caller's grad and inference modes, which are per thread, for the
        # CPU ranks' threads: a run under torch.no_grad() runs every rank's fn
        # without grad. (Inference mode implies no grad.)
        modes = torch.inference_mode if torch.is_inference_mode_enabled() else functools.partial(
            torch.set_grad_enabled, torch.is_grad_enabled())

        def call(rank: int) -> None:
            try:
                if self.streams is None:
                    _C.mark_simulated_rank_thread()  # a CPU timeout's message then names no thread trouble
                    with modes():
                        results[rank] = fn(rank)
                else:
                    results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every rank finished
                with lock:
                    errors.append(e)
            finally:
                finished[rank].set()

        if self.streams is None:
            threads = [threading.Thread(target=call, args=(r,), name=f"moe_a2a_rank{r}") for r in range(self.ep_size)]
            # The rank threads start with SIGINT blocked and keep it so (a
            # thread inherits the mask): Ctrl-C then reaches this thread, whose
            # join it interrupts (delivered to a rank thread, it would wake
            # nobody), and never falls between two starts.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                try:
                    for t in threads:
                        t.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                for t in threads:
                    t.join()
            except BaseException:
                # Interrupted (KeyboardInterrupt in join): the ranks' calls would
                # go on waiting for each other until their timeout, and a reset()
                # meanwhile would re-initialize rows under them. An error record
                # in every row ends every wait within about a millisecond (a
                # failed peer), so the ranks are done when this raises.
                _C.record_interrupted_rows(self.workspace)
                for t, event in zip(threads, finished):
                    if t.ident is not None:  # started
                        event.wait()
                raise
        else:
            current = torch.cuda.current_stream(self.device)
            for rank, stream in enumerate(self.streams):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    call(rank)
            for stream in self.streams:
                current.wait_stream(stream)
        if errors:
            raise errors[0]
        return results

    def reset(self) -> None:
        """Re-initialize every rank's row after a failure (a peer that timed
        out, a call a kernel refused): the workspace stays failed until every
        rank is initialized again.

        Waits for every rank's queued work first (CUDA: the whole device; no
        rank may be inside a call, as :meth:`run` leaves them), initializes
        each row with its metainfo's error mailbox, so ``metainfo`` and the
        graphs captured with it stay valid, and waits for that too.

        Raises:
            RuntimeError: a thread of this process is inside a call on a
                rank's row (CPU): that row, and the ones after it, are left
                as they were (the ones before it are initialized); call again
                once that call returned.
        """
        if self.streams is not None:
            torch.cuda.synchronize(self.device)
        for meta in self.metainfo:
            reinitialize_row(self.workspace, meta)
        if self.streams is not None:
            torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[[int], T]) -> tuple["RankGraphs", list[T]]:
        """CUDA only: capture ``fn(rank)`` into one CUDA graph per rank and return
        the graphs and ``fn``'s results in rank order.

        ``fn(rank)`` is called on the host in rank order inside
        ``torch.cuda.graph(..., stream=self.streams[rank])``: it must enqueue
        all of rank ``rank``'s work of a step (say its dispatch, its experts,
        its combine with a preallocated ``output``) on the current stream;
        nothing runs until :meth:`RankGraphs.replay`. Tensors that ``fn``
        allocates belong to the rank's graph pool and are rewritten by every
        replay. An exception raised by ``fn`` ends the capture and propagates
        (capturing launches nothing, so no peer is left waiting).

        Args:
            fn: called once per rank with the rank, inside that rank's capture.

        Returns:
            ``(graphs, results)``: the :class:`RankGraphs` to replay, and
            ``[fn(0), ..., fn(ep_size - 1)]``.

        Raises:
            RuntimeError: simulated ranks on the CPU (CUDA graphs need a CUDA device).
            BaseException: what ``fn`` or the capture raises, at once (the
                later ranks are not captured).
        """
        if self.streams is None:
            raise RuntimeError("SimulatedEP.capture: CUDA graphs need simulated ranks on a CUDA device")
        graphs: list[torch.cuda.CUDAGraph] = []
        results: list[T] = []
        for rank, stream in enumerate(self.streams):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                results.append(fn(rank))
            graphs.append(graph)
        return RankGraphs(self, graphs), results

    def _check_rank(self, fn: str, rank: Any) -> None:
        """A rank of this object: an int (not a bool: True would index as 1) in [0, ep_size)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.ep_size:
            raise ValueError(f"{fn}: rank must be an int in [0, {self.ep_size}), got {rank!r}")

    def _check_per_rank(self, fn: str, args: dict, kwargs: dict) -> None:
        """Every per-rank argument (``args``, and the lists or tuples among the
        per-rank ``kwargs``) has one entry per rank. Checked before any rank
        runs: a short list would fail only the ranks past its end, after their
        peers waited for them until the timeout, and leave the workspace failed."""
        for name, value in args.items():
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{fn}: {name} must be a list or tuple of ep_size={self.ep_size} entries (one per "
                                 f"rank), got {type(value).__name__}")
        per_rank = {k: v for k, v in kwargs.items() if k in _PER_RANK_KWARGS and isinstance(v, (list, tuple))}
        for name, value in {**args, **per_rank}.items():
            if len(value) != self.ep_size:
                raise ValueError(f"{fn}: {name} must have ep_size={self.ep_size} entries (one per rank), "
                                 f"got {len(value)}")

    def _rank_kwargs(self, kwargs: dict, rank: int) -> dict:
        return {
            k: (v[rank] if k in _PER_RANK_KWARGS and isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()
        }

    def dispatch_rank(
        self,
        rank: int,
        token_selected_experts: torch.Tensor,
        input_payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        top_k: int,
        num_experts: int,
        **kwargs: Any,
    ) -> tuple[list[torch.Tensor], int, Optional[torch.Tensor]]:
        """Rank ``rank``'s ``moe_a2a_dispatch`` on the current stream (a
        function of :meth:`run` or :meth:`capture` calls it on the rank's
        stream), with this object's workspace and metainfo (and so its timeout); returns
        ``(output_payloads, combine_payload_offset, eplb_gathered_stats)``.
        ``kwargs`` go to ``moe_a2a_dispatch``.

        Args:
            rank: the rank, an int in ``[0, ep_size)``.
            token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                top_k, num_experts: rank ``rank``'s, as for ``moe_a2a_dispatch``.
            **kwargs: the other arguments of ``moe_a2a_dispatch`` (not the
                workspace, metainfo, ep_rank and ep_size, which this object gives).

        Returns:
            What ``moe_a2a_dispatch`` returns: ``(output_payloads,
            combine_payload_offset, eplb_gathered_stats)``, or an
            :class:`~torch_moe_a2a.ExpertMajorDispatch` with ``expert_major=True``.

        Raises:
            ValueError: ``rank`` not an int in ``[0, ep_size)`` (a bool
                included); what ``moe_a2a_dispatch`` raises.
            RuntimeError: what ``moe_a2a_dispatch`` raises (peers that did not
                arrive within the timeout, or passed another
                ``runtime_max_tokens_per_rank`` or other payloads).
        """
        self._check_rank("SimulatedEP.dispatch_rank", rank)
        return moe_a2a_dispatch(
            token_selected_experts,
            input_payloads,
            self.workspace,
            self.metainfo[rank],
            runtime_max_tokens_per_rank,
            rank,
            self.ep_size,
            top_k,
            num_experts,
            **kwargs,
        )

    def combine_rank(
        self,
        rank: int,
        payload: torch.Tensor,
        local_num_tokens: int,
        runtime_max_tokens_per_rank: int,
        top_k: int,
        combine_payload_offset: int,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Rank ``rank``'s ``moe_a2a_combine`` on the current stream, as
        :meth:`dispatch_rank`; ``kwargs`` go to ``moe_a2a_combine``. Under
        :meth:`run` on CUDA pass ``output``: an allocation between two ranks'
        launches may wait for a spinning peer (:meth:`combine` allocates every
        rank's output first).

        Args:
            rank: the rank, an int in ``[0, ep_size)``.
            payload, local_num_tokens, runtime_max_tokens_per_rank, top_k,
                combine_payload_offset: rank ``rank``'s, as for
                ``moe_a2a_combine`` (those of its preceding dispatch).
            **kwargs: the other arguments of ``moe_a2a_combine`` (not the
                workspace, metainfo, ep_rank and ep_size, which this object gives).

        Returns:
            What ``moe_a2a_combine`` returns: the ``[local_num_tokens, *]``
            output, a new tensor or ``output``.

        Raises:
            ValueError: ``rank`` not an int in ``[0, ep_size)`` (a bool
                included); what ``moe_a2a_combine`` raises.
            RuntimeError: what ``moe_a2a_combine`` raises (peers that did not
                arrive within the timeout).
        """
        self._check_rank("SimulatedEP.combine_rank", rank)
        return moe_a2a_combine(
            payload,
            local_num_tokens,
            self.workspace,
            self.metainfo[rank],
            runtime_max_tokens_per_rank,
            rank,
            self.ep_size,
            top_k,
            combine_payload_offset,
            **kwargs,
        )

    def dispatch(
        self,
        token_selected_experts: list[torch.Tensor],
        input_payloads: list[list[torch.Tensor]],
        runtime_max_tokens_per_rank: int,
        top_k: int,
        num_experts: int,
        **kwargs: Any,
    ) -> list[tuple[list[torch.Tensor], int, Optional[torch.Tensor]]]:
        """``moe_a2a_dispatch`` on every rank: ``token_selected_experts[r]`` and
        ``input_payloads[r]`` are rank ``r``'s inputs; returns each rank's
        ``(output_payloads, combine_payload_offset, eplb_gathered_stats)``.

        ``kwargs`` go to ``moe_a2a_dispatch`` (enable_pdl, eplb_local_stats,
        enable_rank_mask, active_rank_mask, backend, recv_view_cache);
        ``eplb_local_stats``, ``active_rank_mask`` and ``enable_pdl`` may be
        lists indexed by rank.

        Args:
            token_selected_experts: one tensor per rank.
            input_payloads: one list of payloads per rank.
            runtime_max_tokens_per_rank, top_k, num_experts: shared by every
                rank, as for ``moe_a2a_dispatch``.
            **kwargs: as above.

        Returns:
            Each rank's result in rank order (:meth:`dispatch_rank`).

        Raises:
            ValueError: ``token_selected_experts``, ``input_payloads`` or a
                per-rank list in ``kwargs`` without exactly ``ep_size`` entries,
                refused before any rank runs (the workspace stays usable);
            ValueError, RuntimeError: what a rank's ``moe_a2a_dispatch``
                raises (the first one raised, after every rank finished).
        """
        self._check_per_rank("SimulatedEP.dispatch", {"token_selected_experts": token_selected_experts,
                                                      "input_payloads": input_payloads}, kwargs)
        return self.run(
            lambda rank: self.dispatch_rank(
                rank,
                token_selected_experts[rank],
                input_payloads[rank],
                runtime_max_tokens_per_rank,
                top_k,
                num_experts,
                **self._rank_kwargs(kwargs, rank),
            )
        )

    def combine(
        self,
        payloads: list[torch.Tensor],
        local_num_tokens: list[int],
        runtime_max_tokens_per_rank: int,
        top_k: int,
        combine_payload_offsets: list[int],
        **kwargs: Any,
    ) -> list[torch.Tensor]:
        """``moe_a2a_combine`` on every rank: ``payloads[r]`` is rank ``r``'s
        ``[ep_size, runtime_max_tokens_per_rank, *]`` expert output,
        ``local_num_tokens[r]`` the number of tokens it dispatched and
        ``combine_payload_offsets[r]`` what its dispatch returned. Returns each
        rank's ``[local_num_tokens[r], *]`` output.

        ``kwargs`` go to ``moe_a2a_combine``; ``output``, ``output_scales``
        (a quantized output's block scales: a tensor per rank),
        ``active_rank_mask`` and ``enable_pdl`` may be lists indexed by rank.

        Args:
            payloads, local_num_tokens, combine_payload_offsets: one entry per
                rank, as above.
            runtime_max_tokens_per_rank, top_k: shared by every rank, those of
                the dispatch.
            **kwargs: as above. On CUDA without ``output``, every rank's
                output is allocated before any rank launches.

        Returns:
            Each rank's output in rank order.

        Raises:
            ValueError: ``payloads``, ``local_num_tokens``,
                ``combine_payload_offsets`` or a per-rank list in ``kwargs``
                without exactly ``ep_size`` entries, refused before any rank
                runs (the workspace stays usable);
            ValueError, RuntimeError: what a rank's ``moe_a2a_combine``
                raises (the first one raised, after every rank finished).
        """
        self._check_per_rank("SimulatedEP.combine", {"payloads": payloads, "local_num_tokens": local_num_tokens,
                                                     "combine_payload_offsets": combine_payload_offsets}, kwargs)
        if self.streams is not None and kwargs.get("output") is None:
            # Allocate every rank's output before any rank launches: a device
            # allocation between two launches may serialize them, and rank
            # r's combine spins until rank r + 1's has started.
            dtype = kwargs.get("output_dtype")
            kwargs = dict(kwargs)
            kwargs["output"] = []
            for n, p in zip(local_num_tokens, payloads):
                out_dtype = p.dtype if dtype is None else dtype
                # The op's shape (packed fp4: two elements a byte).
                shape = _C.combine_output_shape(n, list(p.shape[2:]), out_dtype)
                kwargs["output"].append(torch.empty(shape, dtype=out_dtype, device=self.device))

        return self.run(
            lambda rank: self.combine_rank(
                rank,
                payloads[rank],
                local_num_tokens[rank],
                runtime_max_tokens_per_rank,
                top_k,
                combine_payload_offsets[rank],
                **self._rank_kwargs(kwargs, rank),
            )
        )

    def recv_counts(self, rank: int) -> torch.Tensor:
        """int32 ``[ep_size]`` view of rank ``rank``'s receive counts (``moe_a2a_get_recv_counts``).

        Args:
            rank: the rank, an int in ``[0, ep_size)``.

        Returns:
            The view: ``[s]`` = rows rank ``rank`` received from rank ``s`` by
            the last dispatch.

        Raises:
            ValueError: ``rank`` not an int in ``[0, ep_size)`` (a bool included).
        """
        self._check_rank("SimulatedEP.recv_counts", rank)
        return moe_a2a_get_recv_counts(self.workspace, self.metainfo[rank], rank)


class RankGraphs:
    """One CUDA graph per simulated rank, from :meth:`SimulatedEP.capture`.

    ``graphs[r]`` is rank ``r``'s graph. :meth:`replay` launches each on its
    rank's stream, forked from and joined into the current stream as
    :meth:`SimulatedEP.run` does, so a replay is ordered like ordinary work.
    """

    def __init__(self, sim: SimulatedEP, graphs: list["torch.cuda.CUDAGraph"]):
        self._sim = sim
        self.graphs = graphs

    def replay(self) -> None:
        """Launch every rank's graph on its rank's stream, forked from and joined into the current stream."""
        self._sim.run(lambda rank: self.graphs[rank].replay())
