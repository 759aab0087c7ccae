// How many columns a rank must be late in before the heatmap names it: the fewest that noise alone
// would give with probability under NOISE_ALPHA. Each cell leaves its neutral band upwards by chance
// with probability at most CELL_NOISE (2.5 standard errors: 0.6% for a normal mean; 1% allows heavier
// tails), so "late in 2 of 100 columns" is what a healthy rank shows now and then, not a line.
export const CELL_NOISE = 0.01;
export const NOISE_ALPHA = 1e-3;

/** The smallest k >= 2 with P(Binomial(columns, CELL_NOISE) >= k) <= NOISE_ALPHA. */
export function fewestLateColumns(columns, p = CELL_NOISE, alpha = NOISE_ALPHA) {
  let pmf = (1 - p) ** columns; // P(X = 0)
  let below = 0; // P(X < k)
  for (let k = 0; k <= columns; k++) {
    if (k >= 2 && 1 - below <= alpha) return k;
    below += pmf;
    pmf *= ((columns - k) / (k + 1)) * (p / (1 - p));
  }
  return Math.max(2, columns + 1); // more than there are: too few columns to tell a line from noise
}
