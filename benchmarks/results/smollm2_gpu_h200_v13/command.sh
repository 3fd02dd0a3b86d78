# Session 14: two back-to-back box calls; the 93 MB GGUF is carried in two halves (carry is 64 MiB a call):
#   head -c 49181216 $GGUF > .box/gg_a/part; tail -c +49181217 $GGUF > .box/gg_b/part; gguf + accelerate wheels,
#   run.sh (this folder) and the file's md5 in .box/gg_b
# call 1, carry [.box/box.sh, .box/gg_a]:  bash .box/box.sh build && cp .box/gg_a/part /tmp/gguf_a
# call 2, carry [.box/box.sh, .box/gg_b]:  bash .box/gg_b/run.sh      (-> run.log, test_hf.log, demo.log)
