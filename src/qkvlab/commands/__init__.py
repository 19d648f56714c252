"""One module per `qkvlab` verb (or small family of verbs), between the CLI and the libraries.

Each verb has an options dataclass (what the command line gives it, typed, with the CLI's
defaults), a `run_<verb>(options) -> int` that does the work and prints, and the argparse
registration of its subparser in `add_parser(sub)`. Modules here import the libraries inside the
run functions only, so that `qkvlab --help` and every other verb stay fast.
"""
