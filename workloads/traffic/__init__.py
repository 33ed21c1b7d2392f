"""What a load sends and how it is timed: workloads and their requests, datasets and tokenizers' sizers, the target and
its routing, the streaming client (the one timing definition), request errors, local processes and ports."""
