# `python -m loongforge.train ...` (what torchrun / deepspeed --module run). The guard matters:
# spawned decode workers re-import the main module and must not start a run.
if __name__ == "__main__":
    from loongforge.train.launch import main

    main()
