"""The offline commands, apart from the training loop: plan's layout comparison, score, pretrain,
eval, sample, report, export, serve-reward and the config's documentation. Each is
called from driver/cli.py and may import the loop's modules; none of the loop imports them."""
