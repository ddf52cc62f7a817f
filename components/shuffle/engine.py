"""Fused shuffle engine: run a ``StagePlan`` round by round, double-buffered.

Per round r (a token block) the engine
  1. gathers the rows of round r into the send staging slot (r % 2) -- or sends views when the
     source rows are a range -- and starts the transfer;
  2. while round r is in flight, lands round r-1: in (peer, segment) order it scatters (copy) or
     accumulates (add) the arrived rows into the destination.
Rows a rank sends to itself never touch the transport: they are copied/added directly at their
place in the landing order. Staging buffers live in a ``Workspace`` reused across calls.

Two transfers, chosen per stage from the plan's global mean segment size (identical on all
ranks, so everyone picks the same one):
  segmented  one isend/irecv per (peer, expert segment), received straight into the expert-major
             slots and sent straight from them: no staging copy on the slot side. Pays when
             segments are large (each message has a fixed cost).
  coalesced  one all_to_all_single per round through staging: fewest messages, one staging copy
             on the slot side. Pays when segments are small.

``mode="copy"``: every destination row is written once (dispatch). ``mode="add"``: rows are
summed into a zero-initialized destination (combine). The two are adjoint: the backward of a
stage is the reversed stage in the other mode, which is all ``ShuffleFunction`` does.

``collective=True`` runs the same plan the way reference dispatchers do: gather every send into
one fresh contiguous buffer, one ``all_to_all_single``, then a separate scatter pass. The
baselines use it; it moves the same rows with extra copies and no pipelining.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from components.shuffle.plan import Message, StagePlan

Mode = Literal["copy", "add"]
WORKSPACE_GROWTH = 1.25  # over-allocate staging a little so slightly larger calls reuse it


@dataclass
class Meter:
    """Bytes this rank moved: over the transport (to other ranks), and locally (memory passes)."""

    bytes_sent: int = 0
    bytes_internode: int = 0
    bytes_copied: int = 0  # rows written by gathers, scatters, permutes, weighting, reductions
    bytes_side: int = 0  # side lanes sent along with the rows (the fused path's probabilities)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_internode = self.bytes_copied = self.bytes_side = 0

    def copied(self, t: Tensor) -> None:
        self.bytes_copied += t.numel() * t.element_size()


class Workspace:
    """Staging buffers keyed by (role, parity, width, dtype, device), grown on demand, never freed."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, Tensor] = {}

    def get(self, role: str, parity: int, rows: int, like: Tensor) -> Tensor:
        width = like.shape[1]
        key = (role, parity, width, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(int(rows * WORKSPACE_GROWTH) + 1, width, dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:rows]


@dataclass
class Transport:
    """How a stage talks: the process group, reusable staging, accounting, and the engine kind."""

    group: dist.ProcessGroup | None
    workspace: Workspace = field(default_factory=Workspace)
    meter: Meter = field(default_factory=Meter)
    collective: bool = False
    min_segment_bytes: int = 1 << 20  # below: coalesce a round into one all_to_all_single

    def global_rank(self, peer: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return peer
        return dist.get_global_rank(self.group, peer)


def _as_rows(src: Tensor, stage: StagePlan) -> Tensor:
    if src.shape[0] != stage.src_rows:
        raise ValueError(f"shuffle: source has {src.shape[0]} rows, the plan expects {stage.src_rows}")
    width = 1
    for n in src.shape[1:]:
        width *= n
    return src.reshape(src.shape[0], width).contiguous()


def run_stage(src: Tensor, stage: StagePlan, mode: Mode, transport: Transport) -> Tensor:
    """Move ``src`` rows (src_rows, ...) to a new (dst_rows, ...) tensor as ``stage`` describes."""
    return run_lanes((src,), (stage,), mode, transport)[0]


def run_lanes(srcs: tuple[Tensor, ...], stages: tuple[StagePlan, ...], mode: Mode,
              transport: Transport) -> tuple[Tensor, ...]:
    """Move several tensors whose stages share one message structure (e.g. token rows and their
    probabilities) in the same messages: staging rows are the lanes side by side."""
    rows = [_as_rows(src, stage) for src, stage in zip(srcs, stages)]
    if transport.collective:
        outs = [_run_collective(r, stage, mode, transport, i > 0) for i, (r, stage) in enumerate(zip(rows, stages))]
    else:
        width = sum(r.shape[1] for r in rows)
        segmented = stages[0].segment_rows * width * rows[0].element_size() >= transport.min_segment_bytes
        if (segmented and len(rows) > 1) or len({r.dtype for r in rows}) > 1:
            outs = [_run_fused([r], [stage], mode, transport, i > 0)[0] for i, (r, stage) in enumerate(zip(rows, stages))]
        else:
            outs = _run_fused(rows, list(stages), mode, transport)
    return tuple(out.view((stage.dst_rows,) + tuple(src.shape[1:])) for out, src, stage in zip(outs, srcs, stages))


def _new_dst(stage: StagePlan, mode: Mode, like: Tensor) -> Tensor:
    shape = (stage.dst_rows, like.shape[1])
    if mode == "copy" and stage.dst_covered:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _by_round(stages: list[StagePlan], sends: bool) -> list[list[tuple[Message, ...]]]:
    """Per round, the messages of all lanes side by side (lanes share peers, counts and order)."""
    out: list[list[tuple[Message, ...]]] = [[] for _ in range(stages[0].rounds)]
    for ms in zip(*[(s.sends if sends else s.recvs) for s in stages], strict=True):
        if len({m.count for m in ms}) > 1:
            raise AssertionError("lanes of one hop must share the message structure")
        out[ms[0].round].append(ms)
    return out


def _count_sent(m: Message, buf: Tensor, stage: StagePlan, meter: Meter, side: bool = False) -> None:
    nbytes = buf.numel() * buf.element_size()
    if side:
        meter.bytes_side += nbytes
        return
    meter.bytes_sent += nbytes
    if stage.node_of_peer[m.peer] != stage.node_of_peer[stage.rank]:
        meter.bytes_internode += nbytes


def _rows(t: Tensor, m: Message) -> Tensor:
    return t[m.start : m.start + m.count]


def _land(dst: Tensor, m: Message, rows: Tensor, mode: Mode, meter: Meter) -> None:
    """Put received (or self-sent) ``rows`` at the destination rows of receive message ``m``."""
    if mode == "copy":
        if m.start < 0:
            dst.index_copy_(0, m.rows, rows)
        else:
            _rows(dst, m).copy_(rows)
    elif m.start < 0:
        dst.index_add_(0, m.rows, rows)
    else:
        _rows(dst, m).add_(rows)
    meter.copied(rows)


def _land_self(dst: Tensor, src: Tensor, send: Message, recv: Message, mode: Mode, meter: Meter) -> None:
    if mode == "copy" and recv.start >= 0 and send.start < 0:  # gather straight into the slots
        torch.index_select(src, 0, send.rows, out=_rows(dst, recv))
        meter.copied(_rows(dst, recv))
        return
    rows = _rows(src, send) if send.start >= 0 else src.index_select(0, send.rows)
    if send.start < 0:
        meter.copied(rows)
    _land(dst, recv, rows, mode, meter)


def _gather(src: Tensor, m: Message, out: Tensor, meter: Meter) -> None:
    if m.start >= 0:
        out.copy_(_rows(src, m))
    else:
        torch.index_select(src, 0, m.rows, out=out)
    meter.copied(out)


def _columns(srcs: list[Tensor]) -> list[slice]:
    bounds, at = [], 0
    for s in srcs:
        bounds.append(slice(at, at + s.shape[1]))
        at += s.shape[1]
    return bounds


def _run_fused(srcs: list[Tensor], stages: list[StagePlan], mode: Mode, t: Transport,
               side: bool = False) -> list[Tensor]:
    dsts = [_new_dst(stage, mode, src) for stage, src in zip(stages, srcs)]
    stage = stages[0]
    width = sum(src.shape[1] for src in srcs)
    segmented = stage.segment_rows * width * srcs[0].element_size() >= t.min_segment_bytes
    if segmented:
        sends, recvs = _by_round(stages, sends=True), _by_round(stages, sends=False)
    send_works: list[list] = [[], []]
    land_previous = None
    for r in range(stage.rounds + 1):
        land = None
        if r < stage.rounds:
            for w in send_works[r % 2]:  # staging slot r%2 was last used by round r-2's sends
                w.wait()
            if segmented:
                land, send_works[r % 2] = _post_segmented(srcs, dsts, stages, sends[r], recvs[r], mode, r % 2, t, side)
            else:
                land, send_works[r % 2] = _post_coalesced(srcs, dsts, stages, r, mode, r % 2, t, side)
        if land_previous is not None:
            land_previous()  # round r-1 lands while round r is in flight
        land_previous = land
    for works in send_works:
        for w in works:
            w.wait()
    return dsts


def _post_segmented(srcs, dsts, stages, sends, recvs, mode, parity, t, side):
    """One isend/irecv per (peer, segment) message of one lane; slot-side rows go straight
    from/into views. Returns (land, send works)."""
    (src,), (dst,), (stage,) = srcs, dsts, stages
    me, ops, landing = stage.rank, [], []
    rbuf = t.workspace.get("recv", parity, sum(m.count for (m,) in recvs if m.peer != me), src)
    off = 0
    for (m,) in recvs:
        if m.peer == me:
            landing.append((m, None, None))
            continue
        if mode == "copy" and m.start >= 0:
            buf = _rows(dst, m)  # zero-copy: receive straight into the slots
        else:
            buf, off = rbuf[off : off + m.count], off + m.count
        landing.append((m, buf, len(ops)))
        ops.append(dist.P2POp(dist.irecv, buf, t.global_rank(m.peer), t.group, m.tag))
    out_sends = [m for (m,) in sends if m.peer != me]
    self_sends = iter([m for (m,) in sends if m.peer == me])
    sbuf = t.workspace.get("send", parity, sum(m.count for m in out_sends if m.start < 0), src)
    off, send_ops = 0, []
    for m in out_sends:
        if m.start >= 0:
            buf = _rows(src, m)  # zero-copy: send a view of the source rows
        else:
            buf, off = sbuf[off : off + m.count], off + m.count
            _gather(src, m, buf, t.meter)
        _count_sent(m, buf, stage, t.meter, side)
        send_ops.append(len(ops))
        ops.append(dist.P2POp(dist.isend, buf, t.global_rank(m.peer), t.group, m.tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    per_op = len(works) == len(ops)  # a coalescing backend (NCCL) returns one work for the batch

    def land() -> None:  # in (peer, segment) order, self at its place
        if not per_op:
            for w in works:
                w.wait()
        for m, buf, i in landing:
            if buf is None:
                _land_self(dst, src, next(self_sends), m, mode, t.meter)
                continue
            if per_op:
                works[i].wait()
            if not (mode == "copy" and m.start >= 0):  # else it was received in place
                _land(dst, m, buf, mode, t.meter)

    return land, ([works[i] for i in send_ops] if per_op else list(works))


def _post_coalesced(srcs, dsts, stages, r, mode, parity, t, side):
    """One all_to_all_single for round r: one gather per lane into peer-major staging (self
    included, so the landing adds in peer order), one scatter/add per lane on arrival."""
    stage = stages[0]
    send, recv = stage.send_rounds[r], stage.recv_rounds[r]
    cols = _columns(srcs)
    like = srcs[0].new_empty(0, cols[-1].stop)
    if len(srcs) == 1 and send.start >= 0:  # the round's rows are a range: send a view
        sbuf = srcs[0][send.start : send.start + len(send.rows)]
    else:
        sbuf = t.workspace.get("send", parity, len(send.rows), like)
        for src, st, c in zip(srcs, stages, cols):
            _gather_rows(src, st.send_rounds[r], sbuf[:, c], t.meter)
    for p, n in enumerate(send.splits):
        if p != stage.rank and n:
            isz = sbuf.element_size()
            _count_bytes(n * cols[-1].stop * isz, n * width_of(cols, 0) * isz, stage, p, t.meter, side)
    direct = len(srcs) == 1 and mode == "copy" and recv.start >= 0
    rbuf = dsts[0][recv.start : recv.start + len(recv.rows)] if direct else \
        t.workspace.get("recv", parity, len(recv.rows), like)
    if t.group is None:
        rbuf.copy_(sbuf)
        work = None
    else:
        work = dist.all_to_all_single(rbuf, sbuf, list(recv.splits), list(send.splits), group=t.group,
                                      async_op=True)

    def land() -> None:
        if work is not None:
            work.wait()
        if direct:
            return  # received in place
        for dst, st, c in zip(dsts, stages, cols):
            rows, arrived = st.recv_rounds[r].rows, rbuf[:, c]
            if mode == "copy":
                dst.index_copy_(0, rows, arrived)
            else:
                dst.index_add_(0, rows, arrived)  # sequential in peer-major order: exact sums
            t.meter.copied(arrived)

    return land, ([work] if work is not None else [])


def width_of(cols: list[slice], lane: int) -> int:
    return cols[lane].stop - cols[lane].start


def _count_bytes(total: int, rows_part: int, stage: StagePlan, peer: int, meter: Meter, side: bool) -> None:
    """Bytes to one peer: the first lane counts as rows, further lanes as side data."""
    if side:
        meter.bytes_side += total
        return
    meter.bytes_sent += rows_part
    meter.bytes_side += total - rows_part
    if stage.node_of_peer[peer] != stage.node_of_peer[stage.rank]:
        meter.bytes_internode += rows_part


def _gather_rows(src: Tensor, rr, out: Tensor, meter: Meter) -> None:
    if rr.start >= 0:
        out.copy_(src[rr.start : rr.start + len(rr.rows)])
    else:
        torch.index_select(src, 0, rr.rows, out=out)
    meter.copied(out)


def _run_collective(src: Tensor, stage: StagePlan, mode: Mode, t: Transport, side: bool = False) -> Tensor:
    """Reference execution: permute into one buffer, all_to_all_single, separate scatter pass."""
    if stage.rounds != 1:
        raise ValueError("collective engine runs single-round plans (shuffle.chunks = 1)")
    meter, world = t.meter, len(stage.node_of_peer)
    send_rows = _cat_rows(stage.sends)
    if send_rows.numel() == stage.src_rows and bool((send_rows == torch.arange(stage.src_rows)).all()):
        sbuf = src  # already laid out in wire order
    else:
        sbuf = src.index_select(0, send_rows)  # the permute copy
        meter.copied(sbuf)
    in_splits, out_splits = [0] * world, [0] * world
    for m in stage.sends:
        in_splits[m.peer] += m.count
        if m.peer != stage.rank:
            _count_sent(m, sbuf[: m.count], stage, meter, side)
    for m in stage.recvs:
        out_splits[m.peer] += m.count
    rbuf = torch.empty(sum(out_splits), src.shape[1], dtype=src.dtype, device=src.device)
    if t.group is None:
        rbuf.copy_(sbuf)
    else:
        dist.all_to_all_single(rbuf, sbuf, out_splits, in_splits, group=t.group)
    recv_rows = _cat_rows(stage.recvs)
    if mode == "copy" and stage.dst_covered and bool((recv_rows == torch.arange(stage.dst_rows)).all()):
        return rbuf  # arrival order is already the destination layout
    dst = _new_dst(stage, mode, src)
    (dst.index_copy_ if mode == "copy" else dst.index_add_)(0, recv_rows, rbuf)  # the un-permute
    meter.copied(rbuf)
    return dst


def _cat_rows(messages: tuple[Message, ...]) -> Tensor:
    return torch.cat([m.rows for m in messages]) if messages else torch.empty(0, dtype=torch.long)


class ShuffleFunction(torch.autograd.Function):
    """Differentiable lanes: copy forward -> add backward, add forward -> copy backward."""

    @staticmethod
    def forward(ctx, stages: tuple[StagePlan, ...], mode: Mode, transport: Transport, *srcs: Tensor):  # type: ignore[override]
        ctx.stages, ctx.mode, ctx.transport = stages, mode, transport
        return run_lanes(srcs, stages, mode, transport)

    @staticmethod
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        flipped: Mode = "add" if ctx.mode == "copy" else "copy"
        reverse = tuple(s.reversed() for s in ctx.stages)
        return (None, None, None, *run_lanes(tuple(g.contiguous() for g in grads), reverse, flipped, ctx.transport))


def shuffle(srcs: tuple[Tensor, ...], stages: tuple[tuple[StagePlan, ...], ...], mode: Mode,
            transport: Transport, reverse: bool = False) -> tuple[Tensor, ...]:
    """Run hops in order (or the reversed hops backwards) as one differentiable movement.

    ``stages[h]`` holds one StagePlan per lane for hop h (lanes share the message structure).
    """
    hops = [tuple(s.reversed() for s in hop) for hop in reversed(stages)] if reverse else list(stages)
    out = tuple(srcs)
    for hop in hops:
        out = ShuffleFunction.apply(hop, mode, transport, *out)
    return out
