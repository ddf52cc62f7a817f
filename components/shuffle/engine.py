"""Fused shuffle engine: run a ``StagePlan`` with chunked, double-buffered isend/irecv.

Per round r (a token block) the engine
  1. posts the receives of round r: straight into the destination rows when they form a range
     and the stage copies (dispatch), else into the round's receive staging slot (r % 2);
  2. gathers each send of round r into the send staging slot (r % 2) -- unless the source rows
     are a range, then it sends a view -- and posts the sends (one ``batch_isend_irecv``);
  3. while round r is in flight, lands round r-1: waits for its receives in (peer, segment)
     order and scatters (copy) or accumulates (add) the staged rows into the destination.
Rows a rank sends to itself never touch the transport: they are copied/added directly at their
place in the landing order. Staging buffers live in a ``Workspace`` reused across calls.

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

    def reset(self) -> None:
        self.bytes_sent = self.bytes_internode = self.bytes_copied = 0

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

    def global_rank(self, peer: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return peer
        return dist.get_global_rank(self.group, peer)


def run_stage(src: Tensor, stage: StagePlan, mode: Mode, transport: Transport) -> Tensor:
    """Move ``src`` rows (src_rows, ...) to a new (dst_rows, ...) tensor as ``stage`` describes."""
    if src.shape[0] != stage.src_rows:
        raise ValueError(f"run_stage: source has {src.shape[0]} rows, the plan expects {stage.src_rows}")
    width = 1
    for n in src.shape[1:]:
        width *= n
    rows = src.reshape(src.shape[0], width).contiguous()
    out = (_run_collective if transport.collective else _run_fused)(rows, stage, mode, transport)
    return out.view((stage.dst_rows,) + tuple(src.shape[1:]))


def _new_dst(stage: StagePlan, mode: Mode, like: Tensor) -> Tensor:
    shape = (stage.dst_rows, like.shape[1])
    if mode == "copy" and stage.dst_covered:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _by_round(messages: tuple[Message, ...], rounds: int) -> list[list[Message]]:
    out: list[list[Message]] = [[] for _ in range(rounds)]
    for m in messages:
        out[m.round].append(m)
    return out


def _count_sent(m: Message, buf: Tensor, stage: StagePlan, meter: Meter) -> None:
    nbytes = buf.numel() * buf.element_size()
    meter.bytes_sent += nbytes
    if stage.node_of_peer[m.peer] != stage.node_of_peer[stage.rank]:
        meter.bytes_internode += nbytes


def _rows(t: Tensor, m: Message) -> Tensor:
    return t[m.start : m.start + m.count]


def _land(dst: Tensor, m: Message, rows: Tensor, mode: Mode, meter: Meter) -> None:
    """Put received (or self-sent) ``rows`` at the destination rows of receive message ``m``."""
    if mode == "copy":
        dst.index_copy_(0, m.rows, rows) if m.start < 0 else _rows(dst, m).copy_(rows)
    else:
        dst.index_add_(0, m.rows, rows) if m.start < 0 else _rows(dst, m).add_(rows)
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


def _run_fused(src: Tensor, stage: StagePlan, mode: Mode, t: Transport) -> Tensor:
    dst = _new_dst(stage, mode, src)
    me, meter = stage.rank, t.meter
    sends, recvs = _by_round(stage.sends, stage.rounds), _by_round(stage.recvs, stage.rounds)
    pending_sends: list[list] = [[], []]
    in_flight = None  # (round, [(message, buffer or None, work or None)], coalesced works)
    for r in range(stage.rounds + 1):
        posted = None
        if r < stage.rounds:
            parity = r % 2
            for w in pending_sends[parity]:  # slot r%2 was last used by round r-2's sends
                w.wait()
            ops: list[dist.P2POp] = []
            landing: list[tuple[Message, Tensor | None, int | None]] = []
            staged = sum(m.count for m in recvs[r] if m.peer != me and (mode == "add" or m.start < 0))
            rbuf, off = t.workspace.get("recv", parity, staged, src), 0
            for m in recvs[r]:
                if m.peer == me:
                    landing.append((m, None, None))
                    continue
                if mode == "copy" and m.start >= 0:
                    buf = _rows(dst, m)  # zero-copy: receive straight into the slots
                else:
                    buf, off = rbuf[off : off + m.count], off + m.count
                landing.append((m, buf, len(ops)))
                ops.append(dist.P2POp(dist.irecv, buf, t.global_rank(m.peer), t.group, m.tag))
            out_sends = [m for m in sends[r] if m.peer != me]
            sbuf, off = t.workspace.get("send", parity, sum(m.count for m in out_sends if m.start < 0), src), 0
            send_idx = []
            for m in out_sends:
                if m.start >= 0:
                    buf = _rows(src, m)  # zero-copy: send a view of the source rows
                else:
                    buf, off = sbuf[off : off + m.count], off + m.count
                    torch.index_select(src, 0, m.rows, out=buf)
                    meter.copied(buf)
                _count_sent(m, buf, stage, meter)
                send_idx.append(len(ops))
                ops.append(dist.P2POp(dist.isend, buf, t.global_rank(m.peer), t.group, m.tag))
            works = dist.batch_isend_irecv(ops) if ops else []
            per_op = len(works) == len(ops)
            pending_sends[parity] = [works[i] for i in send_idx] if per_op else list(works)
            posted = (r, [(m, b, works[i] if per_op and i is not None else None) for m, b, i in landing],
                      [] if per_op else list(works))
        if in_flight is not None:
            r_done, items, coalesced = in_flight
            for w in coalesced:
                w.wait()
            self_sends = iter([m for m in sends[r_done] if m.peer == me])
            for m, buf, work in items:
                if buf is None:
                    _land_self(dst, src, next(self_sends), m, mode, meter)
                    continue
                if work is not None:
                    work.wait()
                if mode == "add" or m.start < 0:
                    _land(dst, m, buf, mode, meter)
        in_flight = posted
    for works in pending_sends:
        for w in works:
            w.wait()
    return dst


def _run_collective(src: Tensor, stage: StagePlan, mode: Mode, t: Transport) -> Tensor:
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
            _count_sent(m, sbuf[: m.count], stage, meter)
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
    """Differentiable stage: copy forward -> add backward, add forward -> copy backward."""

    @staticmethod
    def forward(ctx, src: Tensor, stage: StagePlan, mode: Mode, transport: Transport) -> Tensor:  # type: ignore[override]
        ctx.stage, ctx.mode, ctx.transport = stage, mode, transport
        return run_stage(src, stage, mode, transport)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        flipped: Mode = "add" if ctx.mode == "copy" else "copy"
        return run_stage(grad.contiguous(), ctx.stage.reversed(), flipped, ctx.transport), None, None, None


def shuffle(src: Tensor, stages: tuple[StagePlan, ...], mode: Mode, transport: Transport,
            reverse: bool = False) -> Tensor:
    """Run stages in order (or the reversed stages backwards) as one differentiable movement."""
    plan = [s.reversed() for s in reversed(stages)] if reverse else list(stages)
    out = src
    for stage in plan:
        out = ShuffleFunction.apply(out, stage, mode, transport)
    return out
