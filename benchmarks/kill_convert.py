"""SIGKILL during `mosaic-shatter convert` at random points: afterwards the output either does not exist
or passes `mosaic-shatter verify`, and no directory that is not complete opens as a vault. A killed
convert leaves only its hidden partial directory, which the next run of the same convert resumes: each
kill point's convert resumes the work the previous kills left, and a last run completes it.

    python benchmarks/kill_convert.py [--points 50] [--seed 0] [--source examples/stdlib-moe]

Prints one JSON line: kill points tried, outputs that existed (all verified), incomplete directories that
opened as a vault (must be 0), whether the partial directory opened as a vault at any point (must not),
and the last run: whether it verified and how many records it found already written.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHATTER = [sys.executable, "-m", "mosaic_shatter.cli"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", default=str(ROOT / "examples" / "stdlib-moe"))
    args = ap.parse_args()
    from mosaic_runtime.vault import VaultError, open_vault
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t = time.perf_counter()
        subprocess.run([*SHATTER, "convert", args.source, "-o", str(out), "--quant", "q4", "--quiet"], check=True,
                       capture_output=True)
        full_s = time.perf_counter() - t
        shutil.rmtree(out)
        existed = opened_incomplete = verified = 0
        for _ in range(args.points):
            proc = subprocess.Popen([*SHATTER, "convert", args.source, "-o", str(out), "--quant", "q4", "--quiet",
                                     "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0, full_s * 1.1))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if not out.exists():
                continue
            existed += 1
            ok = subprocess.run([*SHATTER, "verify", str(out)], capture_output=True).returncode == 0
            verified += ok
            if not ok:
                try:
                    open_vault(out).close()
                    opened_incomplete += 1
                except VaultError:
                    pass
            shutil.rmtree(out)
        partial = Path(tmp) / ".out.partial"
        try:
            open_vault(partial).close()
            partial_opened = True
        except (VaultError, OSError):
            partial_opened = False
        last = subprocess.run([*SHATTER, "convert", args.source, "-o", str(out), "--quant", "q4", "--quiet"],
                              capture_output=True, text=True)
        resumed = last.stdout.split("resumed: ")[1].split()[0] if "resumed: " in last.stdout else "0"
        last_ok = last.returncode == 0 and subprocess.run([*SHATTER, "verify", str(out)], capture_output=True).returncode == 0
    print(json.dumps({"points": args.points, "convert_s": round(full_s, 2), "outputs_existed": existed,
                      "outputs_verified": verified, "incomplete_that_opened": opened_incomplete,
                      "partial_opened": partial_opened, "last_run_verified": last_ok,
                      "last_run_resumed_records": int(resumed)}))


if __name__ == "__main__":
    main()
