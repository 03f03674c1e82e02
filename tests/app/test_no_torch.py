"""The web process never imports torch: it reads the database only (numpy serves provisional results)."""

from __future__ import annotations

import subprocess
import sys


def test_the_web_app_and_its_pages_do_not_import_torch():
    probe = (
        "import sys; from app.main import create_app; from app.config import Settings; "
        "import app.pages, app.provisional, app.jobs, app.routes.jobs; "
        "create_app(Settings(database_url='sqlite:///:memory:')); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr
