"""What a serving process loads: the upstream proxy over SQLite holds no Alembic (a current or new store needs no
migration), no Python git library (the release store runs the git binary) and no PostgreSQL dialect, which kept
11-12 MiB of its resident memory (issue #41: RSS against LiteLLM's)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_upstream_server_loads_no_alembic_git_library_or_postgres_dialect(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from reef_core.config.compose import compose_config
        from reef_core.loop.assemble import build_deployment
        from reef_core.plugins import get_plugin_manager
        from reef_core.serve.app import create_app

        pm = get_plugin_manager()
        for _ in range(2):  # a new data directory, then the same one again
            cfg = compose_config(["engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                                  "storage.data_dir={tmp_path}"], pm)
            app = create_app(build_deployment(cfg, pm))
        unwanted = ("alembic", "mako", "pygments", "git", "sqlalchemy.dialects.postgresql", "torch")
        print(sorted(m for m in unwanted if m in sys.modules))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
