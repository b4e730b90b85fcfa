"""Reproducible benchmarks, each a module run from the repository root as
`python -m benchmarks.<name>` (`--help` for its options). Each prints its figures and
writes a JSON result under benchmarks/results/ (tracked: the docs cite them); the corpora
and runs they generate go under runs/. Those that need ../shared/data say so and exit 0
when it is absent.

    dedup             exact + MinHash near dedup on planted duplicates
    quality           each quality rule and the default chains; spaCy / datatrove agreement
    langid            fastText lid.176 vs CLD2: accuracy, docs/s
    segment           Chinese/Japanese/Thai words: ICU vs whitespace
    classifier        `methods`: CV keep rates of every quality method on the labelled
                      pages; `perplexity`: the perplexity rule's reference model
    packing           bfd vs concat: efficiency, tokens/s, bounds
    prep              `stages`: the whole prep, per stage; `scale`: at 100k, 1M, 10M docs
    cluster           1M documents: a local Dask cluster vs the process pool
    cluster_limit     10M documents on Dask workers with a memory limit: partitioned vs single
    datatrove_compare the scale prep done with datatrove (.venv-datatrove)
    spacy_reference   spaCy's reference answers (.venv-spacy)
    train_cpu         tinyshakespeare on CPU vs classic nanoGPT
    mup               `sweep`: LR across widths, SP vs muP; `transfer`: hpo at 64 -> 256
    hpo               the demo hyperparameter search
    recipe_cost       ms/step of each recipe option
    checkpoint_stall  background vs synchronous checkpoint, S3 upload
    ui_check          what a Prefect user sees, in headless Chromium
    evals             in-loop evals: `overhead` share of training; `signal`: separation
                      and a garbage switch detected and blamed
    eval_agreement    our multiple-choice scores vs lm-evaluation-harness on ARC-Easy
    ablate            three data recipes compared by their proxies (the `ablate` flow)
    partitioned       the partitioned run-once prep steps (max_task_memory)
    near_item_bytes   near clustering's partitioned tasks: bytes per edge and per candidate
    pair_bytes        a partitioned dedup's keepers task: bytes per duplicate pair
    parallel_cpu      ms/step per device mesh at 2 processes on CPU
    incremental       a nightly version on a large history: the dedup index vs re-reading
                      every earlier hash and signature, vs prepping the new data alone

What they share (paths, the shared-data lookup, result writing, RSS sampling, the
generated corpora) is in benchmarks/common.py. Nothing is imported here: datatrove_compare
and spacy_reference run in virtual environments without the project's dependencies.
"""
