"""`python -m dtorch_worker`: the same as the `dtorch-worker` console script."""

from dtorch_worker.cli import main

if __name__ == "__main__":
    main()
