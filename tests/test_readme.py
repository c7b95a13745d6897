"""README's two set-up commands are the public contract: keep them true and keep CI on them."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def test_two_setup_commands():
    commands = re.findall(r"^python3 -m venv .*$", _read("README.md"), flags=re.M)
    assert len(commands) == 2
    train, test = commands
    assert train.endswith("dtx train experiments/digits_mlp.py")
    assert test.endswith("-m pytest")


def test_ci_runs_the_readme_test_command():
    ci = _read(".ci/run")
    assert "grep -m1 -E '^python3 -m venv .* -m pytest' README.md" in ci and 'eval "$command"' in ci
