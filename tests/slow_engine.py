"""An engine module for tests: the reference engine, slowed before its imports.

``python -m slow_engine ...`` (with ``tests/`` on ``PYTHONPATH``) reads the directory named by
``SLOW_ENGINE_DIR`` when it starts: run as a warm standby (``--standby``) it sleeps the seconds
in ``standby_s`` there, else those in ``fresh_s`` (no file: no sleep), then runs the reference
engine's ``main()`` unchanged. A test gets a standby that stays ``warming`` as long as it needs,
or fresh spawns slower than any standby, without changing the engine's environment (a changed
environment would discard the standby); while a file ``standby_hold`` exists there a standby
waits on (the test decides when it may get ready). A file ``standby_thread`` there makes a
standby start a thread (so that it is not fork-safe).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    name = "standby_s" if "--standby" in sys.argv else "fresh_s"
    control = Path(os.environ.get("SLOW_ENGINE_DIR", "/nonexistent")) / name
    if control.exists():
        time.sleep(float(control.read_text()))
    hold = control.parent / "standby_hold"
    while "--standby" in sys.argv and hold.exists():  # warming until the test lets it go
        time.sleep(0.05)
    if "--standby" in sys.argv and (control.parent / "standby_thread").exists():
        import threading  # a standby that is not single-threaded: it must refuse to fork

        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    from rollsafe.adapters.reference_engine.__main__ import exit_fast, main

    exit_fast(main())
