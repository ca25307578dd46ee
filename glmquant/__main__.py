"""`python -m glmquant` (and `torchrun -m glmquant encode ...`): the glmquant command."""

from glmquant.cli import main

if __name__ == "__main__":
    main()
