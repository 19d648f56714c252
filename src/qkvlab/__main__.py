"""`python -m qkvlab` and the `qkvlab` program (pyproject's entry point)."""

from qkvlab import interrupts


def run() -> int:
    interrupts.defer()  # before any import that takes time: see qkvlab/interrupts.py
    from qkvlab.cli import main  # only now: the CLI's imports take a few hundred ms

    return main()


if __name__ == "__main__":
    raise SystemExit(run())
