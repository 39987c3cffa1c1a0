"""Run GPU correctness checks of kernel variants in child processes, so that one broken variant costs a
timeout or a restart instead of the whole run (used by bench/gluon_flash_fwd.py and bench/gluon_flash_bwd.py).

A kernel that deadlocks (an mbarrier wait that is never satisfied) never returns, and a CUDA fault poisons
the process's context for every variant after it. So the parent starts ``script --check-only --variants
a,b,...``; the child checks the variants in order, printing ``@@START name`` and ``@@RESULT name VERDICT``
around each (``check_one``) and stopping at its first exception; the parent echoes the child's output,
kills it when a variant is silent for ``per_variant_s`` (reported HANG), and starts a new child for the
variants left.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time


def check_one(name: str, check) -> str:
    """Run ``check() -> (ok, detail)`` for variant ``name`` in this process between the markers the parent
    parses. Returns "PASS", "FAIL" (wrong numbers) or "ERROR" (an exception, with its root cause)."""
    print(f"@@START {name}")
    sys.stdout.flush()
    t0 = time.time()
    try:
        ok, detail = check()
        verdict = "PASS" if ok else "FAIL"
        print(f"[{name}] {verdict}: {detail} ({time.time() - t0:.1f}s incl. compile)")
    except Exception as e:  # noqa: BLE001 - any failure is this variant's result
        verdict = "ERROR"
        print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:800]}")
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        if root is not e:
            print(f"[{name}]   caused by {type(root).__name__}: {str(root)[:800]}")
    print(f"@@RESULT {name} {verdict}")
    sys.stdout.flush()
    return verdict


def run_checks(script: str, variants, extra_args=(), startup_s: float = 180.0, per_variant_s: float = 120.0):
    """Check ``variants`` through child processes of ``script`` (see the module docstring). Returns the
    passing variants, in the given order."""
    passing, todo = [], list(variants)
    while todo:
        cmd = [sys.executable, script, "--check-only", "--variants", ",".join(todo), *extra_args]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines: queue.Queue = queue.Queue()

        def pump(stream=child.stdout, sink=lines):
            for ln in stream:
                sink.put(ln)
            sink.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, progressed, deadline = None, False, time.time() + startup_s
        while True:
            try:
                ln = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                child.kill()  # the child this function started, by its handle
                child.wait()
                victim = current or todo[0]
                print(f"[{victim}] HANG: no result within {per_variant_s if current else startup_s:.0f}s, "
                      f"child killed")
                todo.remove(victim)
                break
            if ln is None:
                child.wait()
                if current is not None:
                    print(f"[{current}] ERROR: the check process died (exit code {child.returncode})")
                    todo.remove(current)
                elif not progressed and todo:
                    print(f"check process exited with code {child.returncode} before checking {todo}")
                    todo = []
                break
            if ln.startswith("@@START "):
                current = ln.split()[1]
                deadline = time.time() + per_variant_s
            elif ln.startswith("@@RESULT "):
                _, name, verdict = ln.split()
                if verdict == "PASS":
                    passing.append(name)
                todo.remove(name)
                current, progressed, deadline = None, True, time.time() + per_variant_s
            else:
                print(ln, end="")
            sys.stdout.flush()
    return [v for v in variants if v in passing]
