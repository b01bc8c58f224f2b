#!/usr/bin/env bash
# One piece of the FedBR Table 1 RotatedMNIST campaign: FedAvg and FedBR, seeds 0, 1, 2, 1000 rounds, the paper's
# protocol and metric (experiments/table1_rotmnist.yaml). It runs for at most MINUTES (default 14; or a duration
# such as 530s, so that a GPU slot's last part-minute is used too), then stops
# after the last round that fits, leaving every run's state in campaigns/table1 (CAMPAIGN_OUT: another folder);
# the same command continues. Exit 0: the campaign is complete; 75: a piece ended, run it again. Further
# arguments go to fedbr-sweep (data-dir=..., --jobs 2 for two runs at once, or a later --seeds), the key=value
# ones first.
# docs/reproducing.md says what to commit.
# engine=cohort: on one GPU the 10 clients step together (cohort-step=auto: a CUDA graph), 0.63x the time of a
# round of engine=clients for FedBR and 0.66x for FedAvg (docs/benchmarks.md); FedAvg seed 0's first 512 rounds
# ran on engine=clients, which a resumed run may change.
#   experiments/campaign_table1.sh 14 data-dir=/data
#   experiments/campaign_table1.sh 14 --jobs 2 data-dir=/data
set -u
limit=14
if [[ $# -gt 0 && "$1" != -* && "$1" != *=* ]]; then # else MINUTES was left out: the default
    limit="$1"
    shift
fi
[[ "$limit" =~ ^[0-9]+$ ]] && limit="${limit}m" # a plain number is minutes
settings=() options=() # key=value first: an option such as --seeds would take the ones after it as its values
for arg in "$@"; do
    if [[ "$arg" == *=* && "$arg" != -* ]]; then settings+=("$arg"); else options+=("$arg"); fi
done
exec fedbr-sweep experiments/table1_rotmnist.yaml --only FedAvg FedBR --seeds 0 1 2 \
    --out "${CAMPAIGN_OUT:-campaigns/table1}" --time-limit "$limit" engine=cohort "${settings[@]}" "${options[@]}"
