package crashpoint

// The points, one constant each, named <package>.<operation>.<state
// reached>: the process dies right after that state is reached and before
// the next step.
const (
	// Control plane (internal/controlplane).

	// CreateRecorded: the creating record (generation 1) is written, the
	// install not yet sent.
	CreateRecorded = "controlplane.create.recorded"
	// CreateInstalled: the worker acknowledged the install, the record
	// does not say running yet and the client has no answer.
	CreateInstalled = "controlplane.create.installed"
	// PauseFrozen: the worker froze the execution, the record still says
	// pausing.
	PauseFrozen = "controlplane.pause.frozen"
	// ResumeThawed: the worker thawed the execution, the record still says
	// resuming.
	ResumeThawed = "controlplane.resume.thawed"
	// MoveReserved: the generation is bumped and the new route recorded
	// as pending, nothing installed yet.
	MoveReserved = "controlplane.move.reserved"
	// MoveInstalled: the target acknowledged the new execution, its route
	// is not published.
	MoveInstalled = "controlplane.move.installed"
	// MovePublished: the new route is published, the old execution is not
	// retired on its worker yet.
	MovePublished = "controlplane.move.published"
	// KillMarked: the record says killed, the worker has not torn the
	// execution down.
	KillMarked = "controlplane.kill.marked"
	// SnapshotArchived: the worker stored the archive, the snapshot is
	// not recorded and the sandbox is not thawed.
	SnapshotArchived = "controlplane.snapshot.archived"
	// RotateBegun: a key rotation is recorded in the store (its new key,
	// this replica its owner), the bundle does not hold the new key.
	RotateBegun = "controlplane.rotate.begun"
	// RotatePublished: the bundle holds the new key, the rotation is not
	// committed (nobody signs with it).
	RotatePublished = "controlplane.rotate.published"

	// Worker (internal/sbxmanager).

	// InstallActivated: the execution runs and its bridge verified it; its
	// runtime record is not persisted.
	InstallActivated = "sbxmanager.install.activated"
	// InstallPersisted: the runtime record is durable, the install is not
	// acknowledged.
	InstallPersisted = "sbxmanager.install.persisted"
	// WorkerPaused: the worker froze the execution, the pause is not
	// acknowledged to the control plane.
	WorkerPaused = "sbxmanager.pause.frozen"
	// WorkerResumed: the worker thawed the execution, the resume is not
	// acknowledged.
	WorkerResumed = "sbxmanager.resume.thawed"
	// TeardownStopped: the activation is stopped, its runtime record not
	// deleted and its files not removed.
	TeardownStopped = "sbxmanager.teardown.stopped"

	// Snapshots (internal/snapshot).

	// ArchiveEntry: an entry of a writable-layer archive is written (@N:
	// after the Nth entry), the archive is incomplete.
	ArchiveEntry = "snapshot.archive.entry"
	// RestoreEntry: an entry of an archive is restored into a new writable
	// layer (@N: the Nth), the rest is not.
	RestoreEntry = "snapshot.restore.entry"
	// PutWritten: a snapshot's content is written to the store's
	// temporary file, which is not yet renamed into place.
	PutWritten = "snapshot.put.written"
)

// Point is one crash point: its name and where it is.
type Point struct {
	Name, Where string
}

// Points lists every point, in the order of the operations they cut; the
// crash-point suite iterates them (a point missing here cannot be armed).
var Points = []Point{
	{CreateRecorded, "controlplane.createSandbox: after the creating record, before the install"},
	{InstallActivated, "sbxmanager.Install: after activation, before the record put"},
	{InstallPersisted, "sbxmanager.Install: after the record put, before the ack"},
	{CreateInstalled, "controlplane.createSandbox: after the install ack, before the running record"},
	{WorkerPaused, "sbxmanager.Pause: after the freeze, before the ack"},
	{PauseFrozen, "controlplane.pauseSandbox: after the worker froze it, before the paused record"},
	{WorkerResumed, "sbxmanager.Resume: after the thaw, before the ack"},
	{ResumeThawed, "controlplane.resumeSandbox: after the worker thawed it, before the running record"},
	{MoveReserved, "controlplane.move: after the generation bump, before the target install"},
	{MoveInstalled, "controlplane.move: after the target install, before the route is published"},
	{MovePublished, "controlplane.move: after the route is published, before the old execution is retired"},
	{KillMarked, "controlplane.killSandbox: after the killed record, before the worker teardown"},
	{TeardownStopped, "sbxmanager.Teardown: after the activation stopped, before the record delete"},
	{SnapshotArchived, "controlplane.snapshotSandbox: after the worker stored the archive, before thaw and snapshot record"},
	{RotateBegun, "controlplane.RotateKey: after the rotation record, before the bundle holds the new key"},
	{RotatePublished, "controlplane.carryOutRotation: after the bundle is published, before the commit"},
	{ArchiveEntry, "snapshot.Archive: after each entry written (mid-archive)"},
	{PutWritten, "snapshot.Local.Put: after the content is written, before fsync and rename"},
	{RestoreEntry, "snapshot.Restore: after each entry restored (mid-restore)"},
}
