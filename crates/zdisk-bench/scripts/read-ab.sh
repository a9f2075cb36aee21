#!/bin/bash
# read-ab.sh BIN_A BIN_B ROUNDS CORPUS: two zdisk builds side by side on tmpfs
# (default codec, --recompress off), CORPUS copied into each; per round,
# 1 MiB sequential reads (fio nbd, QD8 x 2 jobs) and 4 KiB random reads
# (QD16 x 2 jobs) in MB/s, A and B interleaved.
D=/dev/shm/read-ab; rm -rf $D; mkdir -p $D
fio_seq() { fio --name=sr --ioengine=nbd --uri="$1" --rw=read --bs=1M --iodepth=8 --numjobs=2 --offset_increment=256M --size=256M --loops=3 --group_reporting --output-format=json 2>/dev/null | sed -n '/^{/,$p' | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(round(j['jobs'][0]['read']['bw_bytes']/1e6))"; }
fio_rr() { fio --name=rr --ioengine=nbd --uri="$1" --rw=randread --bs=4k --iodepth=16 --numjobs=2 --size=512M --runtime=6 --time_based --group_reporting --output-format=json 2>/dev/null | sed -n '/^{/,$p' | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(round(j['jobs'][0]['read']['bw_bytes']/1e6))"; }
for X in A B; do
  BIN=$1; [ $X = B ] && BIN=$2
  $BIN create $D/$X.zdisk --logical 600M >/dev/null
  $BIN serve $D/$X.zdisk --socket $D/$X.sock --recompress off 2>/dev/null &
  for i in $(seq 50); do [ -S $D/$X.sock ] && break; sleep 0.1; done
  nbdcopy "$4" "nbd+unix:///?socket=$D/$X.sock"
done
for r in $(seq ${3:-3}); do
  for X in A B; do echo "round $r $X seq $(fio_seq "nbd+unix:///?socket=$D/$X.sock") rr $(fio_rr "nbd+unix:///?socket=$D/$X.sock")"; done
done
pkill -f "serve $D/" ; sleep 1
