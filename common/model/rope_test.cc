#include "common/model/rope.h"

#include <cmath>

#include "gtest/gtest.h"

namespace specserve {
namespace {

constexpr double kPi = 3.14159265358979323846;

ModelConfig Base(int head_dim, double theta) {
  ModelConfig c;
  c.hidden_size = head_dim * 4;
  c.intermediate_size = 8;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.head_dim = head_dim;
  c.vocab_size = 8;
  c.rope_theta = theta;
  return c;
}

TEST(RopeTest, DefaultIsThetaPowerWithUnitFactor) {
  RopeFrequencies f = ComputeRopeFrequencies(Base(8, 10000.0));
  ASSERT_EQ(f.inv_freq.size(), 4u);
  EXPECT_DOUBLE_EQ(f.inv_freq[0], 1.0);
  EXPECT_DOUBLE_EQ(f.inv_freq[1], 0.1);   // 10000^(-2/8)
  EXPECT_DOUBLE_EQ(f.inv_freq[2], 0.01);  // 10000^(-4/8)
  EXPECT_DOUBLE_EQ(f.inv_freq[3], 0.001);
  EXPECT_EQ(f.attention_factor, 1.0);
}

TEST(RopeTest, LinearDividesEveryFrequency) {
  ModelConfig c = Base(8, 10000.0);
  c.rope_scaling.type = "linear";
  c.rope_scaling.factor = 4.0;
  RopeFrequencies f = ComputeRopeFrequencies(c);
  EXPECT_DOUBLE_EQ(f.inv_freq[0], 0.25);
  EXPECT_DOUBLE_EQ(f.inv_freq[3], 0.00025);
  EXPECT_EQ(f.attention_factor, 1.0);
}

TEST(RopeTest, Llama3KeepsShortWavelengthsScalesLongOnesSmoothsBetween) {
  // Llama 3.1's values: theta 500000, head_dim 128, factor 8, low 1,
  // high 4, original 8192: wavelengths < 2048 kept, > 8192 divided by 8.
  ModelConfig c = Base(128, 500000.0);
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  RopeFrequencies f = ComputeRopeFrequencies(c);
  RopeFrequencies plain = ComputeRopeFrequencies(Base(128, 500000.0));
  int kept = 0, scaled = 0, smoothed = 0;
  for (int i = 0; i < 64; ++i) {
    const double wavelen = 2 * kPi / plain.inv_freq[i];
    if (wavelen < 2048) {
      EXPECT_EQ(f.inv_freq[i], plain.inv_freq[i]) << i;
      ++kept;
    } else if (wavelen > 8192) {
      EXPECT_DOUBLE_EQ(f.inv_freq[i], plain.inv_freq[i] / 8) << i;
      ++scaled;
    } else {
      // Strictly between the two limits, and monotone in the wavelength.
      EXPECT_LT(f.inv_freq[i], plain.inv_freq[i]) << i;
      EXPECT_GT(f.inv_freq[i], plain.inv_freq[i] / 8) << i;
      ++smoothed;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(scaled, 0);
  EXPECT_GT(smoothed, 0);
  // At wavelength exactly 4096 (= original / 2) the smooth factor is 1/3:
  // inv = (2/3) inv / 8 + (1/3) inv. Checked through the formula's inverse:
  // any smoothed dim satisfies (inv' - inv/8) / (inv - inv/8) = smooth.
  for (int i = 0; i < 64; ++i) {
    const double wavelen = 2 * kPi / plain.inv_freq[i];
    if (wavelen < 2048 || wavelen > 8192) continue;
    const double smooth = (8192 / wavelen - 1.0) / 3.0;
    const double p = plain.inv_freq[i];
    EXPECT_NEAR((f.inv_freq[i] - p / 8) / (p - p / 8), smooth, 1e-12) << i;
  }
  EXPECT_EQ(f.attention_factor, 1.0);
}

TEST(RopeTest, YarnRampAndAttentionFactor) {
  // head_dim 64, theta 10000, original 2048, factor 4, betas 32 / 1:
  // correction dims 64 ln(2048 / (2 pi r)) / (2 ln 10000) for r = 32, 1:
  // 8.06 -> floor 8 and 20.1 -> ceil 21.
  ModelConfig c = Base(64, 10000.0);
  c.max_position_embeddings = 8192;
  c.rope_scaling.type = "yarn";
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 2048;
  RopeFrequencies f = ComputeRopeFrequencies(c);
  RopeFrequencies plain = ComputeRopeFrequencies(Base(64, 10000.0));
  for (int i = 0; i < 32; ++i) {
    const double p = plain.inv_freq[i];
    if (i <= 8) {
      EXPECT_DOUBLE_EQ(f.inv_freq[i], p) << i;  // extrapolated
    } else if (i >= 21) {
      EXPECT_DOUBLE_EQ(f.inv_freq[i], p / 4) << i;  // interpolated
    } else {
      const double ramp = (i - 8) / 13.0;
      EXPECT_NEAR(f.inv_freq[i], p / 4 * ramp + p * (1 - ramp), 1e-15) << i;
    }
  }
  EXPECT_NEAR(f.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-15);

  c.rope_scaling.attention_factor = 1.5;
  EXPECT_EQ(ComputeRopeFrequencies(c).attention_factor, 1.5);
  c.rope_scaling.attention_factor = 0;
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 0.5;
  EXPECT_NEAR(ComputeRopeFrequencies(c).attention_factor,
              (0.1 * std::log(4.0) + 1) / (0.05 * std::log(4.0) + 1), 1e-15);
}

}  // namespace
}  // namespace specserve
