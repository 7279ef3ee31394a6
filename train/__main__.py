# `python -m loongforge.train ...` (what torchrun / deepspeed --module run). The guard matters:
# spawned decode workers re-import the main module and must not start a run.
if __name__ == "__main__":
    import sys

    from loongforge.train.resilience.rundir import refuse_before_imports

    refuse_before_imports(sys.argv[1:])  # a fresh run over checkpoints: exit 2 before torch is imported
    from loongforge.train.launch import main

    main()
