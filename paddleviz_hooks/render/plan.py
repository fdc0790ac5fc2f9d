"""How a viewing picture is planned: its detail, direction and rows, within a few engine runs.

Every sized picture (the viewing PNG and its SVG, VisualDL's viewer
picture, a diff drawing, any ``fit_png`` drawing) is planned here, once:

* The caller lists **candidates**, most detailed first (the graph as it is,
  then layers collapsed deeper to shallower, then repeated blocks folded).
  Each gives its DOT source for a direction.
* The **size model** (``render/sizes.py``) predicts each candidate's layout
  in each arrangement (top-down; left to right; left to right wrapped into
  rows that read like lines of text) without running the engine. The most
  detailed candidate predicted legible (labels at ``min_dpi``) in the best
  arrangement is drawn.
* Each **attempt** is one engine run that writes the requested formats and
  ``-Tplain`` together (``-Gdpi=96`` with ``-Gsize`` as the frame, so the
  engine scales the drawing to the largest size that fits). The plain output
  says how large the layout really is and how it was scaled; an illegible
  attempt corrects the model for this structure and the next candidate is
  tried; a legible one may be followed by one more detailed candidate the
  corrected model now predicts legible. At most ``MAX_ATTEMPTS`` runs; the
  best attempt's pictures are kept, so no extra run draws the result.
* The **decision** (which candidate, direction, rows, measured size) is
  cached by structure: a later capture of the same structure costs exactly
  one engine run per picture.

Rows read in order: wrapped rows (left to right only; a top-down drawing is
never wrapped into columns, whose edges would run upward) are kept only when
every edge inside a row runs forward, rows are stacked in order, and every
edge between rows leaves the end of one row and enters the start of the next.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator

from .engine import run_engine_formats
from .sizes import DotSizes, read_dot

__all__ = ["Candidate", "Frame", "Decision", "Planned", "draw_planned", "clear_plan_cache", "MAX_ATTEMPTS",
           "FULL_DPI", "VIEW_ASPECT", "PAD_IN"]

FULL_DPI = 96.0
VIEW_ASPECT = 16 / 9
PAD_IN = 4 / 72  # Graphviz's default pad, added on every side
#: Engine runs a new structure's picture may take (its drawing included).
MAX_ATTEMPTS = 3
#: A node takes at least this area (square inches; a 0.75 x 0.3 in box): a candidate
#: with more nodes than the frame holds at ``min_dpi`` is not even written as DOT.
_MIN_NODE_AREA = 0.225
#: A candidate whose nodes alone (``DotSizes.min_area``, times this) exceed the frame at
#: ``min_dpi`` is not laid out: encoders of 2-48 layers at every collapse level, both
#: directions, measured 1.9x (3 boxes and a legend) to 6x that bound with ``dot -Tplain``.
_AREA_SLACK = 1.0
#: Wrapped rows measured against the model (LeNet, a 2-layer encoder, resnet18 in 2-5 rows):
#: a row is about 1.2x as long as its predicted length, the rows together 0.7x as high.
_ROW_ALONG, _ROW_ACROSS = 1.2, 0.7


@dataclass(frozen=True)
class Frame:
    """The bitmap's bounds in pixels; a strip is padded to ``aspect`` (None: not padded)."""

    width: int
    height: int
    aspect: float | None = VIEW_ASPECT

    def dpi(self, w: float, h: float) -> float:
        """The resolution a layout of ``w`` x ``h`` inches is drawn at inside the frame."""
        return min(FULL_DPI, (self.width - 1) / max(w + 2 * PAD_IN, 1e-3),
                   (self.height - 1) / max(h + 2 * PAD_IN, 1e-3))

    def size_arg(self) -> str:
        cw = (self.width - 1) / FULL_DPI - 2 * PAD_IN
        ch = (self.height - 1) / FULL_DPI - 2 * PAD_IN
        return f"-Gsize={cw:.3f},{ch:.3f}"


@dataclass
class Candidate:
    """One level of detail: ``source(rankdir)`` gives its DOT text; ``spec`` names it
    (what the caller needs to build it again); ``nodes`` its node count."""

    spec: Hashable
    nodes: int
    source: Callable[[str], str]
    data: Any = None  # the caller's (e.g. the collapsed graph)


@dataclass(frozen=True)
class Decision:
    """What was chosen for one structure, reused for every later capture of it."""

    spec: Hashable
    rankdir: str
    bands: int
    cuts: frozenset  # edges (tail, head) that stop constraining ranks, so rows restart
    width: float  # the layout in inches, unscaled (as -Tplain gives it)
    height: float
    dpi: float
    in_order: bool = True


@dataclass
class Planned:
    """The pictures and how they were planned."""

    outputs: dict[str, bytes]
    decision: Decision
    candidate: Candidate | None
    attempts: int
    padded: bool = False


@dataclass
class _Arrangement:
    rankdir: str
    bands: int
    band: dict[str, int] = field(default_factory=dict)
    width: float = 0.0
    height: float = 0.0
    dpi: float = 0.0
    crossed: int = 0  # layers a row break cuts through (0: rows break between blocks)

    @property
    def aspect(self) -> float:
        return max(self.width, self.height) / max(min(self.width, self.height), 1e-3)


class _Cache:
    def __init__(self, size: int = 128) -> None:
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            v = self._items.get(key)
            if v is not None:
                self._items.move_to_end(key)
            return v

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)


_DECISIONS = _Cache()
_CORRECTIONS = _Cache()  # structure -> {rankdir: (along, across)}: measured / predicted


def clear_plan_cache() -> None:
    """Forget every decision and size correction (benchmarks time a first drawing with it)."""
    global _DECISIONS, _CORRECTIONS
    _DECISIONS, _CORRECTIONS = _Cache(), _Cache()


def draw_planned(
    key: Hashable,
    candidates: Iterable[Candidate],
    formats: tuple[str, ...],
    frame: Frame,
    *,
    rankdirs: tuple[str, ...] = ("TB", "LR"),
    min_dpi: float,
    timeout: float | None,
    structure: Hashable = None,
    build: Callable[[Hashable], Candidate] | None = None,
    extra_args: tuple[str, ...] = (),
) -> Planned:
    """Plan and draw one picture; see the module docstring.

    Args:
        key: the structure and every option that changes the picture (the cache key).
        candidates: most detailed first (consumed lazily).
        formats: ``"png"``/``"svg"`` to write; ``()`` plans only (``-Tplain`` runs).
        frame: the bitmap's bounds.
        rankdirs: directions that may be chosen.
        min_dpi: the legibility floor.
        timeout: seconds per engine run.
        structure: the structure alone (size corrections are shared by its pictures).
        build: the candidate for a cached ``spec`` (default: searched in ``candidates``).
        extra_args: more engine arguments for every run.
    """
    decision = _DECISIONS.get(key)
    if decision is not None:
        cand = build(decision.spec) if build is not None else next(
            c for c in candidates if c.spec == decision.spec)  # type: ignore[union-attr]
        source = _arranged(cand.source(decision.rankdir), decision.cuts)
        out = _run(source, formats, (*_frame_args(frame), *extra_args), timeout) if formats else {}
        out.pop("plain", None)
        return Planned(out, decision, cand, 1 if formats else 0, _padded(out, frame.aspect))
    return _search(key, iter(candidates), formats, frame, rankdirs, min_dpi, timeout, structure, extra_args)


def _frame_args(frame: Frame) -> tuple[str, ...]:
    return (f"-Gdpi={FULL_DPI:.3f}", frame.size_arg())


def _run(source: str, formats: tuple[str, ...], args: tuple[str, ...], timeout: float | None) -> dict[str, bytes]:
    return run_engine_formats(source, tuple(formats) + ("plain",), args=args, timeout=timeout)


@dataclass
class _Tried:
    cand: Candidate
    arr: _Arrangement
    out: dict[str, bytes]
    decision: Decision
    legible: bool


def _search(key, candidates: Iterator[Candidate], formats, frame: Frame, rankdirs, min_dpi, timeout, structure,
            extra_args) -> Planned:
    corr = dict(_CORRECTIONS.get(structure) or {}) if structure is not None else {}
    seen: list[tuple[Candidate, _Reader | None]] = []  # candidates read so far (None: too many nodes)
    exhausted = False
    tried: list[_Tried] = []
    bad: set[tuple[Hashable, str, int]] = set()
    rows_below: dict[Hashable, int] = {}  # detail -> row counts that failed to read in order start here

    def candidate(i: int) -> tuple[Candidate, _Reader | None] | None:
        nonlocal exhausted
        while len(seen) <= i and not exhausted:
            c = next(candidates, None)
            if c is None:
                exhausted = True
                break
            room = (frame.width / min_dpi) * (frame.height / min_dpi)  # square inches legible in the frame
            hopeless = c.nodes * _MIN_NODE_AREA > room
            reader = None if hopeless else _Reader(c)
            if reader is not None and reader.sizes(rankdirs[0]).min_area() * _AREA_SLACK > room:
                reader = None  # its nodes alone (as the size model sizes them) do not fit legibly
            seen.append((c, reader))
        return seen[i] if i < len(seen) else None

    def arrangements(i: int) -> list[_Arrangement]:
        c, reader = candidate(i)  # type: ignore[misc]
        if reader is None:
            return []
        arrs = []
        for rd in rankdirs:
            sizes = reader.sizes(rd)
            ca, cc = corr.get(rd, (1.0, 1.0))
            w, h = sizes.estimate(rd)
            w, h = (w * cc, h * ca) if rd in ("TB", "BT") else (w * ca, h * cc)
            arrs.append(_Arrangement(rd, 1, {}, w, h, frame.dpi(w, h)))
            if rd != "LR" or w / max(h, 1e-3) <= VIEW_ASPECT:
                continue  # only left-to-right strips are wrapped (into rows read like text)
            for k in _band_counts(w, h, frame):
                banded = _bands(sizes, k, reader.extents(rd))
                if banded is None:
                    continue
                band, crossed = banded
                bw, bh = sizes.estimate(rd, band)
                # rows come out longer (uneven) and stack tighter than the model adds them up
                ra, rc = corr.get((rd, "rows"), (_ROW_ALONG, _ROW_ACROSS))
                bw, bh = bw * ca * ra, bh * cc * rc
                arrs.append(_Arrangement(rd, max(band.values()) + 1, band, bw, bh, frame.dpi(bw, bh), crossed))
        limit = rows_below.get(c.spec)
        return [a for a in arrs if (c.spec, a.rankdir, a.bands) not in bad
                and not (a.bands > 1 and limit is not None and a.bands >= limit)]

    def choose(limit: int | None = None, margin: float = 1.0, rows: bool = True) -> tuple[int, _Arrangement] | None:
        i, last = 0, None
        while (limit is None or i < limit) and candidate(i) is not None:
            arrs = [a for a in arrangements(i) if rows or a.bands == 1]
            if arrs:
                best = _best(arrs)
                last = (i, best)
                if best.dpi >= min_dpi * margin:
                    return last
            i += 1
        if last is None and limit is None and seen and seen[-1][1] is None:
            # every candidate has more nodes than the frame can hold legibly: draw the last anyway
            seen[-1] = (seen[-1][0], _Reader(seen[-1][0]))
            return choose(margin=margin, rows=rows)
        return last if limit is None else None

    def attempt(i: int, arr: _Arrangement) -> _Tried:
        c, reader = candidate(i)  # type: ignore[misc]
        base = reader.source(arr.rankdir)  # type: ignore[union-attr]
        source = _rows(base, arr.band) if arr.bands > 1 else base
        out = _run(source, formats, (*_frame_args(frame), *extra_args), timeout)
        plain = out.pop("plain").decode("utf-8", "replace")
        head = plain.split("\n", 1)[0].split()
        scale, w, h = float(head[1]), float(head[2]), float(head[3])
        dpi = FULL_DPI * min(scale, 1.0)
        in_order = arr.bands == 1 or _reads_in_order(plain, arr.rankdir, arr.band)
        # the model's error on this structure, used for the next candidates
        ca, cc = corr.get(arr.rankdir, (1.0, 1.0))
        (pa, pc), (ra, rc) = _along_across(arr.rankdir, arr.width, arr.height), _along_across(arr.rankdir, w, h)
        if arr.bands == 1:
            if c.nodes >= 8:  # (a drawing of a few boxes is mostly its legend)
                corr[arr.rankdir] = (ca * ra / max(pa, 1e-3), cc * rc / max(pc, 1e-3))
        else:  # the rows' own factors, measured
            wa, wc = corr.get((arr.rankdir, "rows"), (_ROW_ALONG, _ROW_ACROSS))
            corr[(arr.rankdir, "rows")] = (wa * ra / max(pa, 1e-3), wc * rc / max(pc, 1e-3))
        cuts = _cut_edges(source) if arr.bands > 1 else frozenset()
        d = Decision(c.spec, arr.rankdir, arr.bands, cuts, w, h, dpi, in_order)
        return _Tried(c, arr, out, d, dpi >= min_dpi and in_order)

    chosen = choose()
    while chosen is not None and len(tried) < MAX_ATTEMPTS:
        i, arr = chosen
        t = attempt(i, arr)
        tried.append(t)
        bad.add((t.cand.spec, arr.rankdir, arr.bands))
        if t.legible:
            # the corrected model may now find a more detailed candidate legible: one try
            if len(tried) < MAX_ATTEMPTS and i > 0:
                better = choose(limit=i, margin=0.93)  # near enough to be worth one run
                if better is not None:
                    t2 = attempt(*better)
                    tried.append(t2)
                    if t2.legible:
                        t = t2
            break
        last = len(tried) == MAX_ATTEMPTS - 1  # the last try: unwrapped (it reads in order), with a margin
        if not t.decision.in_order:
            # more rows would cut deeper into the blocks: this detail gets fewer rows, or none
            rows_below[t.cand.spec] = min(arr.bands, rows_below.get(t.cand.spec, arr.bands))
        # the same detail in another arrangement, or less detail (the corrected model skips
        # what it now knows is too large)
        chosen = choose(margin=1.15, rows=False) or choose(rows=False) if last else choose()
    if structure is not None:
        _CORRECTIONS.put(structure, corr)
    runs = len(tried)
    if not tried:  # nothing could be planned (no candidate at all)
        raise ValueError("nothing to draw")
    good = [t for t in tried if t.legible]
    pick = good[-1] if good else max(tried, key=lambda t: (t.decision.in_order, t.decision.dpi))
    if not pick.decision.in_order:  # never a picture that does not read in order
        raise RuntimeError("no arrangement of this drawing read in order within the engine runs allowed")
    if good:
        # among legible attempts, the most detailed (earliest candidate) wins
        order = {id(c): n for n, (c, _r) in enumerate(seen)}
        pick = min(good, key=lambda t: order.get(id(t.cand), 0))
    _DECISIONS.put(key, pick.decision)
    return Planned(pick.out, pick.decision, pick.cand, runs, _padded(pick.out, frame.aspect))


class _Reader:
    """A candidate's DOT sources and size models, made once per direction."""

    def __init__(self, cand: Candidate) -> None:
        self.cand = cand
        self._src: dict[str, str] = {}
        self._sizes: dict[str, DotSizes] = {}
        self._extents: dict[str, _Extents] = {}

    def source(self, rankdir: str) -> str:
        if rankdir not in self._src:
            self._src[rankdir] = self.cand.source(rankdir)
        return self._src[rankdir]

    def sizes(self, rankdir: str) -> DotSizes:
        if rankdir not in self._sizes:
            self._sizes[rankdir] = read_dot(self.source(rankdir))
        return self._sizes[rankdir]

    def extents(self, rankdir: str) -> "_Extents":
        if rankdir not in self._extents:
            self._extents[rankdir] = _Extents(self.sizes(rankdir))
        return self._extents[rankdir]


def _along_across(rankdir: str, w: float, h: float) -> tuple[float, float]:
    return (h, w) if rankdir in ("TB", "BT") else (w, h)


def _best(arrs: list[_Arrangement]) -> _Arrangement:
    """The highest dpi wins; within 15% of it an unwrapped drawing, then one inside the aspect
    window, then top-down (the rules the viewing PNG always had)."""
    top = max(a.dpi for a in arrs)
    near = [a for a in arrs if a.dpi >= top / 1.15]
    # rows that break between blocks before rows that cut through layers (those seldom read in order)
    near.sort(key=lambda a: (a.bands > 1, a.crossed, a.aspect > VIEW_ASPECT * 1.02, a.rankdir != "TB", -a.dpi))
    return near[0]


def _band_counts(w: float, h: float, frame: Frame) -> list[int]:
    """Row counts worth predicting for a left-to-right strip of ``w`` x ``h`` inches in ``frame``."""
    ideal = math.sqrt(max(w, 1e-3) * frame.height / max(h * frame.width, 1e-3))
    return list(range(2, max(3, min(12, math.ceil(ideal * 2))) + 1))


class _Extents:
    """What wrapping a left-to-right strip into rows needs of one drawing, worked out once for
    every row count: each node's place along the ranks, the gaps between ranks, and the
    place each cluster short of the whole drawing spans (and whether it is one layer's own ops)."""

    def __init__(self, sizes: DotSizes) -> None:
        self.sizes = sizes
        self.pos = pos = sizes.positions("LR")
        self.lo, self.hi = (min(pos.values()), max(pos.values())) if pos else (0.0, 0.0)
        inner = _innermost(sizes)
        self.spans: list[tuple[float, float, bool]] = []  # (start, end, innermost)
        for members in sizes.clusters:
            ps = [pos[n] for n in members if n in pos]
            if ps and max(ps) - min(ps) < 0.9 * (self.hi - self.lo):
                self.spans.append((min(ps), max(ps), id(members) in inner))
        ranks = sorted(set(round(p, 3) for p in pos.values()))
        self.gaps = [(a + b) / 2 for a, b in zip(ranks, ranks[1:])]  # where a row may break

    def allowed(self, k: int) -> list[tuple[float, int]]:
        """The gaps a break into ``k`` rows may use, each with how many layers it cuts
        through: never one layer's own ops, nor a layer that fits in one row (a block)."""
        gaps, n = self.gaps, len(self.gaps)
        crossed, forbidden = [0] * (n + 1), [0] * (n + 1)  # difference arrays over the gaps
        row = (self.hi - self.lo) / k
        for x0, x1, inn in self.spans:
            a, b = bisect.bisect_right(gaps, x0), bisect.bisect_left(gaps, x1)  # gaps strictly inside
            if a >= b:
                continue
            crossed[a] += 1
            crossed[b] -= 1
            if inn or x1 - x0 < row:
                forbidden[a] += 1
                forbidden[b] -= 1
        out, c, f = [], 0, 0
        for i, g in enumerate(gaps):
            c += crossed[i]
            f += forbidden[i]
            if not f:
                out.append((g, c))
        return out


def _bands(sizes: DotSizes, k: int, ext: _Extents | None = None) -> tuple[dict[str, int], int] | None:
    """Each node's row when the rank axis is cut into ``k`` rows, and how many layers the
    most crossing cut goes through; None when no cut is allowed.

    Cuts go between ranks, near the even places, never through one layer's
    own ops (an innermost cluster) or a layer that fits in one row (a
    block), and through as few other layers as they can
    (between blocks where there is such a place nearby); containers may be
    split (a chain of containers, such as LeNet's, could never wrap otherwise).
    ``ext``: ``sizes``'s extents, when already worked out for another ``k``.
    """
    ext = ext if ext is not None else _Extents(sizes)
    pos, lo, hi = ext.pos, ext.lo, ext.hi
    if len(pos) < 2:
        return None
    allowed = ext.allowed(k)
    # the cuts through the fewest layers that still give rows of about even length
    # (at most 1.5x the even length): between blocks where the blocks allow it
    cuts: list[float] | None = None
    level = 0
    for level in sorted({n for _c, n in allowed}):
        cuts = _partition([c for c, n in allowed if n <= level], lo, hi, k)
        if cuts is not None:
            break
    if not cuts:
        return None
    band = {n: bisect.bisect_left(cuts, p) for n, p in pos.items()}  # cuts ascend: how many lie below p
    # a leaf (a parameter, an input) stays in the row of the op that feeds it
    has_succ = {t for t, h, *_ in sizes.edges if h in band}
    for t, h, *_ in sizes.edges:
        if h in band and t in band and h not in has_succ:
            band[h] = band[t]
    return band, level


def _partition(places: list[float], lo: float, hi: float, k: int) -> list[float] | None:
    """Up to ``k - 1`` cuts among ``places`` making the longest row as short as they can,
    or None when that row would be over 1.5x the even length ``(hi - lo) / k``."""
    if not places:
        return None
    even = (hi - lo) / k

    def fill(limit: float) -> list[float] | None:
        cuts, start = [], lo
        while hi - start > limit:
            fits = [c for c in places if start < c <= start + limit]
            if not fits or len(cuts) == k - 1:
                return None
            cuts.append(fits[-1])
            start = fits[-1]
        return cuts

    best = None
    limit = even
    while limit <= 1.5 * even + 1e-9:
        best = fill(limit)
        if best is not None:
            break
        limit += 0.05 * even
    return best or None


def _innermost(sizes: DotSizes) -> set[int]:
    """Clusters holding no other cluster and no collapsed layer box (one layer's own ops).

    Clusters nest (DOT subgraphs), so a cluster holds another one exactly when one of
    its nodes lies in a smaller cluster too.
    """
    smallest: dict[str, int] = {}  # node -> size of the smallest cluster it lies in
    for c in sizes.clusters:
        for n in c:
            if len(c) < smallest.get(n, len(c) + 1):
                smallest[n] = len(c)
    out = set()
    for c in sizes.clusters:
        if c & sizes.boxes:
            continue
        if all(smallest[n] >= len(c) for n in c):
            out.add(id(c))
    return out


def _padded(out: dict[str, bytes], aspect: float | None) -> bool:
    """Widen the short side of ``out["png"]`` (white) so it stays within ``aspect``; whether it was."""
    png = out.get("png")
    if aspect is None or png is None or png[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    if max(w, h) / max(min(w, h), 1) <= aspect:
        return False
    import io

    from PIL import Image

    nw, nh = (w, math.ceil(w / aspect)) if w > h else (math.ceil(h / aspect), h)
    with Image.open(io.BytesIO(png)) as im:
        im.load()
        white = (255,) * len(im.getbands()) if im.mode in ("RGB", "RGBA") else 255
        canvas = Image.new(im.mode, (nw, nh), white)
        canvas.paste(im, ((nw - w) // 2, (nh - h) // 2))
        buf = io.BytesIO()
        canvas.save(buf, format="PNG")
    out["png"] = buf.getvalue()
    return True


# --------------------------------------------------------------------------
# rows: cutting edges, checking the result reads in order
# --------------------------------------------------------------------------
_EDGE_LINE = re.compile(r"^(\s*)(\w+) -> (\w+) \[(.*)\]$")


def _cut(source: str, crosses: Callable[[str, str], bool]) -> str:
    """``source`` with every edge for which ``crosses(tail, head)`` no longer constraining ranks."""
    out = []
    for line in source.split("\n"):
        m = _EDGE_LINE.match(line)
        if m and crosses(m.group(2), m.group(3)):
            rest = m.group(4)
            line = f"{m.group(1)}{m.group(2)} -> {m.group(3)} [constraint=false{', ' if rest else ''}{rest}]"
        out.append(line)
    return "\n".join(out)


def _arranged(source: str, cuts: frozenset) -> str:
    if not cuts:
        return source
    return _rows(source, _bands_of_cuts(source, cuts))


def _bands_of_cuts(source: str, cuts: frozenset) -> dict[str, int]:
    """Each node's row again, from the edges a wrapped drawing cut (rows follow each cut)."""
    sizes = read_dot(source)
    succ: dict[str, list[str]] = {}
    for t, h, _w, _h, _c in sizes.edges:
        succ.setdefault(t, []).append(h)
    band = {n: 0 for n in sizes.nodes}
    rank = sizes.ranks()
    for n in sorted(sizes.nodes, key=lambda n: rank.get(n, 0)):
        for m in succ.get(n, []):
            band[m] = max(band[m], band[n] + (1 if (n, m) in cuts else 0))
    return band


_CLUSTER_LINE = re.compile(r"^\s*subgraph (cluster_\w+) \{$")


def _rows(source: str, band: dict[str, int]) -> str:
    """``source`` wrapped into rows: edges between rows stop constraining ranks, frames of
    layers cut by a row break are left out (they would pull the rows together), and the
    first node of each row is ranked with the others' first nodes, in row order."""
    source = _cut(source, lambda a, b: band.get(a, 0) != band.get(b, 0))
    lines = source.split("\n")
    # which clusters hold nodes of more than one row
    spans: list[set[int]] = []
    stack: list[int] = []
    owner: list[int | None] = []
    for line in lines:
        m = _CLUSTER_LINE.match(line)
        if m:
            spans.append(set())
            stack.append(len(spans) - 1)
            owner.append(len(spans) - 1)
            continue
        if line.strip() == "}" and stack:
            owner.append(stack.pop())
            continue
        owner.append(None)
        nm = re.match(r"^\s*(\w+) \[", line)
        if nm and nm.group(1) in band:
            for c in stack:
                spans[c].add(band[nm.group(1)])
    drop = {c for c, bs in enumerate(spans) if len(bs) > 1}
    out, skipping = [], []
    stack = []
    for line, who in zip(lines, owner):
        if _CLUSTER_LINE.match(line):
            stack.append(who)
            if who in drop:
                continue
        elif line.strip() == "}" and who is not None:
            stack.pop()
            if who in drop:
                continue
        elif stack and stack[-1] in drop and not re.match(r"^\s*\w+ \[", line) and "->" not in line:
            continue  # the dropped frame's own label and style
        out.append(line)
    # row starts: the node of each row nearest its start, one rank, in row order
    sizes = read_dot(source)
    rank = sizes.ranks()
    linked = {t for t, *_ in sizes.edges} | {e[1] for e in sizes.edges}  # not the legend
    entered = {h for t, h, *_ in sizes.edges if band.get(t, 0) != band.get(h, 0)}  # where a row is entered
    firsts = []
    for b in range(max(band.values(), default=0) + 1):
        members = [n for n, bb in band.items() if bb == b and n in rank and n in linked]
        members = [n for n in members if n in entered] or members
        if members:
            firsts.append(min(members, key=lambda n: (rank[n], n)))
    if len(firsts) > 1:
        # a row start's own edges pull harder, so it stays on its row's line
        starts = set(firsts)
        for i, line in enumerate(out):
            m = _EDGE_LINE.match(line)
            if m and m.group(2) in starts and band.get(m.group(2)) == band.get(m.group(3)):
                out[i] = f"{m.group(1)}{m.group(2)} -> {m.group(3)} [weight=8, {m.group(4)}]"
        end = max(i for i, ln in enumerate(out) if ln.strip() == "}")  # the graph's closing brace
        out[end:end] = [f"  {{ rank=same; {'; '.join(firsts)} }}", f"  {' -> '.join(firsts)} [style=invis]"]
    return "\n".join(out)


def _cut_edges(source: str) -> frozenset[tuple[str, str]]:
    found = set()
    for line in source.split("\n"):
        m = _EDGE_LINE.match(line)
        if m and m.group(4).startswith("constraint=false"):
            found.add((m.group(2), m.group(3)))
    return frozenset(found)


def _plain_nodes(plain: str, rankdir: str) -> dict[str, tuple[float, float]]:
    """Node name -> (distance along the rank axis from its start, position across it)."""
    lines = plain.split("\n")
    gh = float(lines[0].split()[3])
    pos: dict[str, tuple[float, float]] = {}
    for line in lines[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[0] == "node" and parts[1] != "legend":
            x, y = float(parts[2]), float(parts[3])
            pos[parts[1].strip('"')] = (gh - y, x) if rankdir == "TB" else (x, gh - y)
    return pos


def _reads_in_order(plain: str, rankdir: str, band: dict[str, int]) -> bool:
    """Whether wrapped rows read like lines of text.

    The rows are stacked in order without overlapping; inside a row every
    edge runs forward; every edge between rows goes from the end of one row
    (its last quarter) to the start of the next (its first quarter).
    """
    pos = _plain_nodes(plain, rankdir)
    k = max(band.values(), default=0) + 1
    along: list[list[float]] = [[] for _ in range(k)]
    across: list[list[float]] = [[] for _ in range(k)]
    for n, b in band.items():
        if n in pos:
            along[b].append(pos[n][0])
            across[b].append(pos[n][1])
    if any(not a for a in along):
        return False
    for b in range(k - 1):
        if max(across[b]) >= min(across[b + 1]):
            return False
    start = min(min(a) for a in along)
    end = max(max(a) for a in along)

    def rel(n: str) -> float:  # position along the row, 0 at the left edge of the drawing, 1 at its right
        return (pos[n][0] - start) / max(end - start, 1e-6)

    def at_end(n: str) -> bool:  # in the last quarter of its own row (the last row may be short)
        a = along[band[n]]
        return pos[n][0] >= min(a) + 0.75 * (max(a) - min(a))

    for line in plain.split("\n"):
        parts = line.split()
        if len(parts) < 3 or parts[0] != "edge":
            continue
        tail, head = parts[1].strip('"'), parts[2].strip('"')
        if tail not in band or head not in band or tail not in pos or head not in pos or "invis" in parts:
            continue  # (the invisible edges keep the rows in order)
        if band[head] == band[tail]:
            if pos[head][0] <= pos[tail][0]:
                return False
        elif band[head] != band[tail] + 1 or rel(head) > 0.25 or not at_end(tail):
            return False
    return True
