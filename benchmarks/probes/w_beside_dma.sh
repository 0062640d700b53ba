set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1
echo "pip rc=$?"
lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA|MHz|Hypervisor|L3' | tee $OUT/topo.txt
nvidia-smi topo -m 2>/dev/null | head -5 | tee -a $OUT/topo.txt
cat /sys/bus/pci/devices/*/numa_node 2>/dev/null | sort | uniq -c | tee -a $OUT/topo.txt
grep -i nvidia /proc/interrupts | head -3 | cut -c1-200 | tee -a $OUT/topo.txt
timeout 300 python3 benchmarks/probes/w_beside_dma.py 5 0.25 2>&1 | tee $OUT/w_beside_dma.jsonl | cut -c1-400
