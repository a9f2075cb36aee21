#!/bin/bash
# read-cpu-ab.sh BIN_A BIN_B ROUNDS CORPUS: two zdisk builds side by side on tmpfs;
# for each round, 1 MiB sequential reads (fio nbd, QD8 x 2 jobs, 1.5 GiB)
# of CORPUS copied into each, and the server CPU seconds per GB they took.
# CPU per byte is steadier than MB/s on a busy host.
D=/dev/shm/cab; rm -rf $D; mkdir -p $D; declare -A PID
for X in A B; do
  BIN=$1; [ $X = B ] && BIN=$2
  $BIN create $D/$X.zdisk --logical 600M >/dev/null
  $BIN serve $D/$X.zdisk --socket $D/$X.sock --recompress off 2>/dev/null &
  PID[$X]=$!
  for i in $(seq 50); do [ -S $D/$X.sock ] && break; sleep 0.1; done
  nbdcopy "$4" "nbd+unix:///?socket=$D/$X.sock"
done
for r in $(seq $3); do
  for X in A B; do
    P=${PID[$X]}; c0=$(awk '{print $14+$15}' /proc/$P/stat)
    fio --name=sr --ioengine=nbd --uri="nbd+unix:///?socket=$D/$X.sock" --rw=read --bs=1M --iodepth=8 --numjobs=2 --offset_increment=256M --size=256M --loops=3 --group_reporting --output-format=json >/dev/null 2>&1
    c1=$(awk '{print $14+$15}' /proc/$P/stat)
    echo "round $r $X: $(/usr/bin/python3 -c "print('%.3f CPU s per GB' % (($c1-$c0)/100/(1.5*1.073741824)))")"
  done
done
kill ${PID[A]} ${PID[B]}; wait 2>/dev/null
