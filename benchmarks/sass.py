"""Reading ``nvdisasm -c`` SASS: the instructions, the loops, and the order of a loop's
synchronisation points (used by ``benchmarks.mosaic_sass``; plain text in, no GPU).

ptxas schedules a kernel's instructions itself: it may sink arithmetic below an
mbarrier arrival or hoist a ``wgmma.wait_group`` above it, so the program order of the
Pallas code (and of the PTX) is not the order that runs. :func:`timeline` shows the
order that runs, one token per event of a loop body.
"""

from __future__ import annotations

import collections
import dataclasses
import re

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`?\(\s*(\.L_x_\d+)\s*\)")


@dataclasses.dataclass(frozen=True)
class Instr:
    addr: int
    op: str  #: the opcode with its modifiers, e.g. ``SYNCS.ARRIVE.TRANS64.A1T0``
    args: str
    pred: str = ""  #: the guard, e.g. ``@!P0``

    @property
    def base(self) -> str:
        """The opcode without modifiers (``SYNCS``)."""
        return self.op.split(".")[0]


def parse(text: str) -> tuple[list[Instr], dict[str, int]]:
    """The instructions of ``nvdisasm -c`` output, in address order, and each label's
    address (the next instruction's)."""
    instrs, labels, pending = [], {}, []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.search(line)
        if m is None:
            continue
        addr = int(m.group(1), 16)
        for name in pending:
            labels[name] = addr
        pending = []
        instrs.append(Instr(addr, m.group(3), m.group(4), (m.group(2) or "").strip()))
    return instrs, labels


def loops(instrs: list[Instr], labels: dict[str, int]) -> list[tuple[int, int]]:
    """``(first, last)`` address of each loop: a guarded branch back to a label at or
    before it, sorted. (ptxas moves a barrier's try-wait retry out of line, to the
    kernel's end, and jumps back from there unguarded: not a loop; the retry itself is
    a loop of a few instructions.)"""
    found = set()
    for ins in instrs:
        if ins.base != "BRA" or not ins.pred:
            continue
        m = _TARGET.search(ins.args)
        if m and m.group(1) in labels and labels[m.group(1)] <= ins.addr:
            found.add((labels[m.group(1)], ins.addr))
    return sorted(found)


def body(instrs: list[Instr], span: tuple[int, int]) -> list[Instr]:
    lo, hi = span
    return [i for i in instrs if lo <= i.addr <= hi]


def mix(instrs: list[Instr], top: int = 16) -> str:
    """The opcode counts, most frequent first (``FMUL 66, FMNMX 36, ...``)."""
    c = collections.Counter(i.base for i in instrs)
    return ", ".join(f"{k} {v}" for k, v in c.most_common(top))


def _event(ins: Instr) -> str | None:
    op = ins.op
    if op.startswith("HGMMA"):
        return "mma"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "wait" + ins.args.split(",")[-1].strip().replace("0x", "")
    if op.startswith("WARPGROUP.ARRIVE"):
        return "fence"
    if op.startswith("SYNCS.ARRIVE"):
        return "arrive"
    if op.startswith("SYNCS.PHASECHK"):
        return "trywait"
    if op.startswith(("BAR.", "BAR")) and ins.base == "BAR":
        return "bar"
    if op.startswith("UTMALDG"):
        return "tma-load"
    if op.startswith("UTMASTG") or op.startswith("UBLKCP"):
        return "tma-store"
    if ins.base == "STS":
        return "sts"
    if ins.base == "MUFU":
        return "mufu"
    if ins.base == "F2FP":
        return "cvt"
    return None


def timeline(instrs: list[Instr]) -> str:
    """The order of a span's events, runs collapsed: ``mma*8 trywait wait0 arrive
    mufu*34 sts*2 arrive ...`` (``mma`` a wgmma, ``waitN`` a ``wgmma.wait_group N``,
    ``fence`` a ``wgmma.fence``, ``arrive`` / ``trywait`` an mbarrier's, ``bar`` a
    named barrier, ``sts`` a shared store, ``mufu`` an exponential or reciprocal,
    ``cvt`` a conversion to bf16/fp16)."""
    out: list[list] = []
    for ins in instrs:
        e = _event(ins)
        if e is None:
            continue
        if out and out[-1][0] == e and e in ("mma", "mufu", "sts", "cvt"):
            out[-1][1] += 1
        else:
            out.append([e, 1])
    return " ".join(e if n == 1 else f"{e}*{n}" for e, n in out)
