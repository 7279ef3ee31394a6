# `python -m loongforge.train ...` (what torchrun / deepspeed --module run). The guard matters:
# spawned decode workers re-import the main module and must not start a run.
if __name__ == "__main__":
    import sys

    from loongforge.train.resilience.rundir import refuse_before_imports

    refuse_before_imports(sys.argv[1:])  # a fresh run over checkpoints: exit 2 before torch is imported
    import os

    from loongforge.train.resilience.elastic.forks import WARM_ENV, stand_in

    if os.environ.get(WARM_ENV):  # a launch of the elastic supervisor: its fork server holds the imports
        stand_in("loongforge.train", sys.argv[1:])  # never returns
    from loongforge.train.launch import main

    main()
