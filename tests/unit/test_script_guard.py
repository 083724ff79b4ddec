"""A script that starts an engine in unguarded top-level code is refused before any process
starts, with the fix named; a guarded one, a function called from the guard, and code
outside a script pass."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = "from envoykit.runtime.platform import refuse_unguarded_script\n"


def run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(CHECK + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )


def test_top_level_start_is_refused_with_the_fix(tmp_path):
    done = run(tmp_path, "refuse_unguarded_script()\n")
    assert done.returncode != 0
    assert 'under `if __name__ == "__main__":`' in done.stderr
    assert "script.py starts an engine in its top-level code (line 2)" in done.stderr


def test_a_function_called_from_unguarded_code_is_refused(tmp_path):
    done = run(tmp_path, "def main():\n    refuse_unguarded_script()\n\nmain()\n")
    assert "(line 5)" in done.stderr


def test_guarded_starts_pass(tmp_path):
    done = run(
        tmp_path,
        """
        def main():
            refuse_unguarded_script()

        if __name__ == "__main__":
            refuse_unguarded_script()
            main()
            print("passed")
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "passed"


def test_python_c_passes():
    done = subprocess.run(
        [sys.executable, "-c", CHECK + "refuse_unguarded_script(); print('passed')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "passed", done.stderr
