"""The checker's core: the subject protocol and its judge, the drivers (lockstep over reference and
fast, judge mode over one subject), the workloads and the Hypothesis machines. The commands built on
it are in `kvledger.checker`, whose package is also the public import path for adapter authors."""
