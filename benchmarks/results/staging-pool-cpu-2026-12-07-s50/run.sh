#!/bin/bash
# before/after, alternated
for i in 1 2; do
  for v in before after; do
    cd /tmp/wt-$v && PYTHONPATH=/tmp/wt-$v /work/main/.venv/bin/python benchmarks/push_vs_pull.py --device cpu --connectors nixl,nixl-push --tp-pairs 3:1,1:3 --prompt-lens 1024 --repeats 4 --out /tmp/stg/$v-$i.json > /tmp/stg/$v-$i.log 2>&1
    echo "$v-$i rc $?" >> /tmp/stg/done.txt
  done
done
