#!/usr/bin/env bash
# Stop the test cluster's daemons (munged is left running).
pkill -x slurmd 2>/dev/null; pkill -x slurmctld 2>/dev/null; exit 0
