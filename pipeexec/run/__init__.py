"""One run, from the validated config to every rank's outcome: `prepare` validates once before
launch, `assemble` builds one rank (the same for training, paired runs and profiling), `worker`
is what a training process does, `paired` trains several runs in one job, `zb_auto` the
switch of a zb-auto run, `preflight` the machine- and file-level checks before any worker
starts. The roof below the CLI: it imports the rooms below, none imports it."""
