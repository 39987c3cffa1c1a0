export TRITON_DEFAULT_FP_FUSION=1
PYTHONPATH=. timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_flash_gluon_bwd.py -k "configs and 128" 2>&1 | tail -2
C=split,64:4:64:4:126,64:4:64:4:62,64:3:64:4:62,split_dkp3
PYTHONPATH=. timeout 380 python3 bench/gluon_bwd_alone.py --seqs 1024,4096,8192,16384 --configs $C,$C > $OUT/alone2.txt 2>&1
tail -42 $OUT/alone2.txt
