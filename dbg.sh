set -e
scripts/setup.sh test >/dev/null
for i in 1 2 3; do
  rm -rf /tmp/accdbg /tmp/pocldbg
  POCL_CACHE_DIR=/tmp/pocldbg ASYNCCLCACHE_STATS=1 .venv/bin/python -m asyncclcache run --dir /tmp/accdbg --stats dbg_driver.py 2>&1 | tail -2
  .venv/bin/python -m asyncclcache list --dir /tmp/accdbg 2>&1 | tail -5
done
