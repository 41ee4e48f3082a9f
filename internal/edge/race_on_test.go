//go:build race

package edge

// raceEnabled: the race detector's shadow memory inflates RSS several
// times over, so RSS bounds are checked only without it.
const raceEnabled = true
