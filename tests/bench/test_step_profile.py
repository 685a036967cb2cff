"""bench/step_profile.py's HLO parsing: kernel names to op names and to fused bodies (no GPU)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import step_profile  # noqa: E402  (a script directory, not a package)

HLO = """HloModule jit_train_step

%fused_computation.52 (param_0.1: f32[8,2048,16,128]) -> f32[16,128] {
  %param_0.1 = f32[8,2048,16,128]{3,2,1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %reduce.3 = f32[16,128]{1,0} reduce(%param_0.1, %c), dimensions={0,1}, to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(attn))/reduce_sum"}
}

ENTRY %main (p: f32[8,2048,16,128]) -> f32[16,128] {
  %p = f32[8,2048,16,128]{3,2,1,0} parameter(0)
  ROOT %input_reduce_fusion.52 = f32[16,128]{1,0} fusion(%p), kind=kInput, calls=%fused_computation.52, metadata={op_name="jit(train_step)/transpose(jvp(attn))/reduce_sum"}
}
"""


def test_kernel_names_map_to_op_names_and_bodies():
  names = step_profile.op_names(HLO)
  assert names["input_reduce_fusion_52"].endswith("transpose(jvp(attn))/reduce_sum")
  bodies = step_profile.fusion_bodies(HLO, ["unknown [x]", "input_reduce_fusion_52 [attention]"], 1)
  assert list(bodies) == ["input_reduce_fusion_52 [attention]"]
  body = bodies["input_reduce_fusion_52 [attention]"]
  assert "dimensions={0,1}" in body and "metadata" not in body
