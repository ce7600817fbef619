"""`kvledger show TRACE -o FILE.png`: page ownership over time.

Replays the trace in lockstep to find the first divergence, then keeps going on the reference
alone, recording after every step what each page is: free, owned by a request (a colour per
uid), cached and unlocked, or cached and locked (darker). x = step, y = page; a red line marks
the first divergence.
"""

from __future__ import annotations

import colorsys
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp, InvariantViolation
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import TraceLine, as_record
from kvledger.engine.ledger.trace import Header
from kvledger.properties.lockstep import Lockstep
from kvledger.properties.target import LockstepTarget

FREE, CACHED, LOCKED, CONFLICT = 0, 1, 2, 3  # request uids take codes from FIRST_UID on
FIRST_UID = 4
BASE_COLOURS = ["#f4f4f4", "#9db4c8", "#2f4f6f", "#000000"]


class ShowError(ValueError):
    pass


def _page_codes(ledger: CacheScheduler, uid_code: Dict[int, int]) -> np.ndarray:
    ps = ledger.page_size
    owners = ledger.cm.page_owners(list(ledger.live.values()))
    row = np.full(ledger.cm.num_pages, FREE, dtype=np.int32)
    for loc, who in owners.items():
        if len(who) != 1:
            code = CONFLICT  # the partition is broken here (only after a divergence)
        elif who[0][0] == "req":
            code = uid_code.setdefault(who[0][1], FIRST_UID + len(uid_code))
        elif who[0][0] == "cache":
            code = LOCKED if who[0][1] > 0 else CACHED
        else:
            code = FREE
        row[int(loc) // ps] = code
    return row


def ownership_matrix(
    header: Header, ops: Sequence[TraceLine]
) -> Tuple[np.ndarray, Dict[int, int], Optional[Finding], int]:
    """Page codes after each step (row 0 is the initial state), the uid -> code map, the first
    divergence (None if none) and the number of steps the reference applied."""
    lock = Lockstep(header)
    uid_code: Dict[int, int] = {}
    rows = [_page_codes(lock.ref, uid_code)]
    divergence: Optional[Finding] = None
    for i, line in enumerate(ops):
        try:
            record = as_record(line)
            if divergence is None:
                try:
                    lock.apply(record)
                except Finding as e:
                    divergence = e
            else:
                lock.ref.apply(record.op)  # the fast side is broken now: follow the model alone
        except InvalidOp as e:
            raise ShowError(f"operation {i + 1} is invalid at that point: {e}") from None
        except InvariantViolation:
            break  # the model itself broke (the divergence says so): nothing more to draw
        try:
            rows.append(_page_codes(lock.ref, uid_code))
        except RuntimeError:
            break
    return np.stack(rows), uid_code, divergence, len(rows) - 1


def _uid_colour(i: int) -> Tuple[float, float, float]:
    hue = (0.07 + i * 0.618034) % 1.0  # golden-ratio hues: neighbours differ
    lightness = (0.45, 0.6, 0.35)[(i // 7) % 3]
    return colorsys.hls_to_rgb(hue, lightness, 0.75)


def render(header: Header, ops: Sequence[TraceLine], out: str | Path, title: str | None = None) -> Optional[Finding]:
    """Draw the trace's page ownership to `out` (PNG); returns the first divergence, if any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    matrix, uid_code, divergence, steps = ownership_matrix(header, ops)
    colours = [matplotlib.colors.to_rgb(c) for c in BASE_COLOURS]
    colours += [_uid_colour(i) for i in range(len(uid_code))]
    cmap = ListedColormap(colours)

    width = min(16.0, 8.0 + steps / 40)
    height = min(10.0, 3.0 + header.num_pages / 12)
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    ax.imshow(
        matrix.T,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        cmap=cmap,
        vmin=-0.5,
        vmax=len(colours) - 0.5,
        extent=(-0.5, steps + 0.5, -0.5, header.num_pages - 0.5),
    )
    ax.set_xlabel("step (0 = before the first operation)")
    ax.set_ylabel("page")
    ax.set_title(
        title
        or f"{header.cache_type} cache, page size {header.page_size}, {header.num_pages} pages, {len(ops)} operations",
        fontsize=10,
    )
    if divergence is not None and divergence.step is not None:
        ax.axvline(divergence.step, color="red", linewidth=1.5)
        right_half = divergence.step > steps / 2  # label on the side with room
        ax.annotate(
            f"first divergence: step {divergence.step}\n{divergence.kind}",
            xy=(divergence.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-6 if right_half else 6, -6),
            textcoords="offset points",
            ha="right" if right_half else "left",
            va="top",
            color="red",
            fontsize=9,
            bbox={"boxstyle": "round", "fc": "white", "ec": "red", "alpha": 0.85},
        )
    legend = [
        Patch(facecolor=BASE_COLOURS[FREE], edgecolor="grey", label="free"),
        Patch(facecolor=BASE_COLOURS[CACHED], label="cached, unlocked"),
        Patch(facecolor=BASE_COLOURS[LOCKED], label="cached, locked"),
    ]
    if (matrix == CONFLICT).any():
        legend.append(Patch(facecolor=BASE_COLOURS[CONFLICT], label="several owners"))
    shown = sorted(uid_code.items(), key=lambda kv: kv[1])
    legend += [Patch(facecolor=colours[code], label=f"request {uid}") for uid, code in shown[:12]]
    if len(shown) > 12:
        legend.append(Patch(facecolor="white", label=f"... {len(shown) - 12} more requests"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return divergence


def main_show(path: str, output: str, bug: str | None = None, target: LockstepTarget | None = None) -> int:
    """`kvledger show TRACE -o FILE.png` on reference against fast (`target`, or fast with `bug`;
    a subject shows only its View, which names no page owner): exit 0 when drawn, 2 on an error."""
    from kvledger.checker.targets import lockstep_target
    from kvledger.engine.ledger.trace import TraceError, read

    target = target or lockstep_target(bug)
    try:
        header, ops = read(path)
        with target.active():
            divergence = render(
                header,
                ops,
                output,
                title=f"{Path(path).name}: {header.cache_type} cache, "
                f"page size {header.page_size}, {header.num_pages} pages, {len(ops)} operations",
            )
    except (OSError, TraceError, ShowError, KeyError) as e:
        print(f"kvledger show: {path}: {e}", file=sys.stderr)
        return 2
    where = f"first divergence at step {divergence.step}: {divergence.kind}" if divergence else "no divergence"
    print(f"wrote {output} ({len(ops)} steps, {header.num_pages} pages; {where})")
    return 0
