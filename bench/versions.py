"""Before/after benchmark: one benchmark script run against two versions of the code, in
alternating rounds (drift of the machine hits both alike).

"before" is a git ref, checked out into a temporary worktree; "after" is this checkout as it is,
or another ref (--after, also a worktree: the checkout can change while the benchmark runs). The benchmark script is this checkout's, for both (the same measurement); each run imports
its version's code (cwd and PYTHONPATH point at it, so every process the CLI starts does too). The
script must write its figures as JSON with --out. Prints every numeric figure's median for
both, the after/before ratio, and the spread of the "before" runs among themselves (the noise a
ratio must beat).

    python bench/versions.py --before 96768dc --rounds 2 -- bench/pipeline.py --steps 40

--hide MODULE (repeatable) makes the "before" runs see MODULE as not installed (importing it
raises ImportError, in every process the runs start): what an optional dependency is worth,
measured side by side, e.g. uvicorn's C HTTP parser:

    python bench/versions.py --before HEAD --hide httptools -- bench/quickstart.py --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def flatten(obj, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = float(obj)
    return out


def run(tree: Path, script: list[str], out: Path, hide: list[str] = ()) -> dict[str, float]:
    shim = out.parent / f"shim-{tree.name}"  # asyncrl_proto is the tree's proto/ (pyproject's package-dir)
    if not shim.exists():
        shim.mkdir()
        (shim / "asyncrl_proto").symlink_to(tree / "proto")
        for module in hide:  # found before site-packages: as if it were not installed
            (shim / module).mkdir()
            (shim / module / "__init__.py").write_text(f"raise ImportError('{module} is hidden by bench/versions.py')\n")
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{shim}"}
    argv = [sys.executable, str(ROOT / script[0]), *script[1:], "--out", str(out)]
    r = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} in {tree} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return flatten(json.loads(out.read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="git ref of the version to compare against")
    p.add_argument("--after", default=None, help="git ref to measure instead of this checkout as it is")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="also write every round's figures as JSON here")
    p.add_argument("--hide", action="append", default=[], metavar="MODULE",
                   help="the before runs see this module as not installed (repeatable)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- bench/X.py [its arguments]")
    a = p.parse_args()
    script = [s for s in a.script if s != "--"]
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        before, after = Path(tmp) / "before", (Path(tmp) / "after" if a.after else ROOT)
        for tree, ref in [(before, a.before), (after, a.after)]:
            if ref:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
                               check=True, capture_output=True)  # fmt: skip
        try:
            for i in range(a.rounds):
                order = [("before", before), ("after", after)] if i % 2 == 0 else [("after", after), ("before", before)]
                for name, tree in order:
                    print(f"round {i + 1}/{a.rounds}: {name} ...", flush=True)
                    hide = a.hide if name == "before" else []
                    results[name].append(run(tree, script, Path(tmp) / f"{name}-{i}.json", hide))
        finally:
            for tree in {before, after} - {ROOT}:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True
                )
    keys = [k for k in results["before"][0] if all(k in r for rs in results.values() for r in rs)]
    hidden = f" without {', '.join(a.hide)}" if a.hide else ""
    print(f"\n{' '.join(script)}: {a.before}{hidden} vs {a.after or 'this checkout'}, {a.rounds} alternating rounds "
          "(medians)")
    print(f"{'figure':58}{'before':>10}{'after':>10}{'after/before':>14}{'before spread':>15}")
    for k in keys:
        b = statistics.median(r[k] for r in results["before"])
        f = statistics.median(r[k] for r in results["after"])
        vals = [r[k] for r in results["before"]]
        spread = (max(vals) - min(vals)) / abs(b) if b else 0.0
        ratio = f"{f / b:.3f}x" if b else "-"
        print(f"{k[:58]:58}{b:>10.3g}{f:>10.3g}{ratio:>14}{spread:>14.1%}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            json.dumps({"refs": [a.before, a.after or "checkout"], "script": script, **results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
