"""The repository root, for tests that read its files or put it on a child process's path."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
