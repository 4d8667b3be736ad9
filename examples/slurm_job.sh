#!/bin/bash
# A Slurm job of many ranks with asyncclcache (docs/mpi.md): `sbatch examples/slurm_job.sh`.
#SBATCH --job-name=sim
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=32
#SBATCH --time=02:00:00
set -euo pipefail

export ASYNCCLCACHE_INSTALL=1                       # every rank caches its builds
export ASYNCCLCACHE_DIR=/scratch/$USER/asyncclcache # on the shared file system: the next job's nodes see it
export ASYNCCLCACHE_STATS=1                         # one line at exit (with mpi4py: one for the job)
# Node-local copies, read by the node's ranks instead of the shared file system: $TMPDIR (often
# one per job, cleaned at its end) or /tmp; bounded, reused by your next job on the node.
# export ASYNCCLCACHE_NODE_DIR=/local/scratch/$USER
# export ASYNCCLCACHE_NODE_MAX_SIZE=2G

# pocl's own kernel cache on node-local disk, shared by the node's ranks (asyncclcache builds a
# program one at a time in it: pocl before 6.0 needs that, pocl#1480).
srun bash -c 'export POCL_CACHE_DIR=${TMPDIR:-/tmp}/pocl-$SLURM_JOB_ID
              exec python driver.py input.yaml'

# Binaries of this job's new entries, made off the job's path, inside the allocation (an
# Epilog runs as root or SlurmUser, not as you): the next job loads them at a binary's speed.
srun --ntasks=1 --nodes=1 python -m asyncclcache bake --jobs "${SLURM_CPUS_ON_NODE:-4}" || true
