package guest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
)

// networkFS are the filesystem magics WatchDir rejects unless
// allow_network_mounts is set (envd 0.6.4): inotify is unreliable on them.
var networkFS = map[int64]string{
	0x6969:     "nfs",
	0x517B:     "smb",
	0xFF534D42: "cifs",
	0xFE534D42: "smb2",
	0x65735546: "fuse",
}

// dirWatch is an fsnotify watch of one directory, optionally recursive.
type dirWatch struct {
	fsw          *fsnotify.Watcher
	root         string
	recursive    bool
	includeEntry bool
	db           *userDB
	// acct is the user the watch acts as: directories are added and
	// entries described with their permissions (runAs).
	acct *account

	mu sync.Mutex
	// uploads tracks writeFile's temp files by their target path, so that
	// the rename into place reports what envd's in-place write would
	// (create and write for a new file, write for an existing one).
	uploads map[string]*upload
}

// upload is one atomic upload seen by a watch.
type upload struct{ existed, wrote bool }

// newDirWatch validates the request and starts watching. The caller must
// call release (which closes the watch) when done.
func (s *Server) newDirWatch(h http.Header, p string, recursive, includeEntry, allowNetwork bool) (*dirWatch, func(), error) {
	acct, db, err := s.userFromAuth(h)
	if err != nil {
		return nil, nil, err
	}
	root, err := ResolvePath(p, acct.Home)
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	err = runAs(acct, func() error {
		st, err := os.Stat(root)
		if err != nil {
			return fsError(err, "error getting directory info for "+quote(root))
		}
		if !st.IsDir() {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %s is not a directory", quote(root)))
		}
		if !allowNetwork {
			var sfs unix.Statfs_t
			if err := unix.Statfs(root, &sfs); err == nil {
				if name, ok := networkFS[int64(sfs.Type)]; ok {
					return connect.NewError(connect.CodeInvalidArgument,
						fmt.Errorf("path %s is on a network mount (%s); watching it requires allowNetworkMounts", quote(root), name))
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, nil, fsError(err, "error watching "+quote(root))
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, nil, errClosing
	}
	if s.nwatches >= s.cfg.MaxWatchers {
		s.mu.Unlock()
		return nil, nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("too many watchers (max %d)", s.cfg.MaxWatchers))
	}
	s.nwatches++
	s.mu.Unlock()
	fsw, err := fsnotify.NewWatcher()
	w := &dirWatch{fsw: fsw, root: root, recursive: recursive, includeEntry: includeEntry, db: db, acct: acct}
	if err == nil {
		// inotify_add_watch needs read permission on the directory: as
		// the user, a directory they cannot read cannot be watched.
		err = runAs(acct, func() error {
			if err := fsw.Add(root); err != nil {
				return err
			}
			if recursive {
				w.addTree(root)
			}
			return nil
		})
		if err != nil {
			_ = fsw.Close()
		}
	}
	if err != nil {
		s.mu.Lock()
		s.nwatches--
		s.mu.Unlock()
		return nil, nil, fsError(err, "error watching "+quote(root))
	}
	var once sync.Once
	release := func() {
		once.Do(func() {
			_ = fsw.Close()
			s.mu.Lock()
			s.nwatches--
			s.mu.Unlock()
		})
	}
	return w, release, nil
}

// addTree adds watches for every directory below dir (best effort: those
// the user cannot read are skipped). Called within runAs.
func (w *dirWatch) addTree(dir string) {
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() && p != dir {
			_ = w.fsw.Add(p)
		}
		return nil
	})
	_ = w.fsw.Add(dir)
}

// convert turns one fsnotify event into envd events (one per op bit) and
// extends a recursive watch to new directories.
func (w *dirWatch) convert(ev fsnotify.Event) []*filesystempb.FilesystemEvent {
	temp := isUploadTemp(filepath.Base(ev.Name))
	newDir := w.recursive && ev.Has(fsnotify.Create)
	var entry *filesystempb.EntryInfo
	if newDir || (w.includeEntry && !temp) {
		_ = runAs(w.acct, func() error {
			if newDir {
				if st, err := os.Lstat(ev.Name); err == nil && st.IsDir() {
					w.addTree(ev.Name)
				}
			}
			if w.includeEntry && !temp {
				entry, _ = entryInfo(ev.Name, w.db)
			}
			return nil
		})
	}
	if temp {
		// Our own atomic-upload temp file: watchers see only the final
		// rename into place, reported as envd's in-place write would be.
		w.trackUpload(ev)
		return nil
	}
	var types []filesystempb.EventType
	if ev.Has(fsnotify.Create) {
		if up := w.takeUpload(ev.Name); up != nil {
			ev.Op &^= fsnotify.Create
			if up.existed {
				types = append(types, filesystempb.EventType_EVENT_TYPE_WRITE) // O_TRUNC rewrite
			} else {
				types = append(types, filesystempb.EventType_EVENT_TYPE_CREATE)
				if up.wrote {
					types = append(types, filesystempb.EventType_EVENT_TYPE_WRITE)
				}
			}
		}
	}
	for _, m := range []struct {
		op fsnotify.Op
		t  filesystempb.EventType
	}{
		{fsnotify.Create, filesystempb.EventType_EVENT_TYPE_CREATE},
		{fsnotify.Write, filesystempb.EventType_EVENT_TYPE_WRITE},
		{fsnotify.Remove, filesystempb.EventType_EVENT_TYPE_REMOVE},
		{fsnotify.Rename, filesystempb.EventType_EVENT_TYPE_RENAME},
		{fsnotify.Chmod, filesystempb.EventType_EVENT_TYPE_CHMOD},
	} {
		if ev.Has(m.op) {
			types = append(types, m.t)
		}
	}
	name, err := filepath.Rel(w.root, ev.Name)
	if err != nil {
		name = ev.Name
	}
	out := make([]*filesystempb.FilesystemEvent, 0, len(types))
	for _, t := range types {
		out = append(out, &filesystempb.FilesystemEvent{Name: name, Type: t, Entry: entry})
	}
	return out
}

func (f *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystempb.WatchDirRequest], stream *connect.ServerStream[filesystempb.WatchDirResponse]) error {
	m := req.Msg
	w, release, err := f.s.newDirWatch(req.Header(), m.GetPath(), m.GetRecursive(), m.GetIncludeEntry(), m.GetAllowNetworkMounts())
	if err != nil {
		return err
	}
	defer release()
	start := &filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Start{Start: &filesystempb.WatchDirResponse_StartEvent{}}}
	if err := stream.Send(start); err != nil {
		return err
	}
	var tick <-chan time.Time
	if iv := keepaliveInterval(req.Header()); iv > 0 {
		t := time.NewTicker(iv)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case ev, ok := <-w.fsw.Events:
			if !ok {
				return nil
			}
			for _, fe := range w.convert(ev) {
				if err := stream.Send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Filesystem{Filesystem: fe}}); err != nil {
					return err
				}
			}
		case err, ok := <-w.fsw.Errors:
			if !ok {
				return nil
			}
			if errors.Is(err, fsnotify.ErrEventOverflow) {
				f.s.log.Warn("watch: event overflow", "path", w.root)
				continue
			}
			return connect.NewError(connect.CodeInternal, fmt.Errorf("watch error: %w", err))
		case <-tick:
			ka := &filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Keepalive{Keepalive: &filesystempb.WatchDirResponse_KeepAlive{}}}
			if err := stream.Send(ka); err != nil {
				return err
			}
		case <-ctx.Done():
			if f.s.ctx.Err() != nil {
				return errClosing
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		case <-f.s.ctx.Done():
			return errClosing
		}
	}
}

// pollWatcher buffers the events of a dirWatch for GetWatcherEvents.
type pollWatcher struct {
	w       *dirWatch
	release func()
	max     int

	mu      sync.Mutex
	events  []*filesystempb.FilesystemEvent
	dropped int
	err     error
}

func (p *pollWatcher) stop() { p.release() }

// run collects events until the watch is closed. Owned by the server.
func (p *pollWatcher) run() {
	for {
		select {
		case ev, ok := <-p.w.fsw.Events:
			if !ok {
				return
			}
			fes := p.w.convert(ev)
			p.mu.Lock()
			for _, fe := range fes {
				if len(p.events) >= p.max {
					p.dropped++
					continue
				}
				p.events = append(p.events, fe)
			}
			p.mu.Unlock()
		case err, ok := <-p.w.fsw.Errors:
			if !ok {
				return
			}
			if !errors.Is(err, fsnotify.ErrEventOverflow) {
				p.mu.Lock()
				p.err = err
				p.mu.Unlock()
			}
		}
	}
}

func newWatcherID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (f *filesystemService) CreateWatcher(_ context.Context, req *connect.Request[filesystempb.CreateWatcherRequest]) (*connect.Response[filesystempb.CreateWatcherResponse], error) {
	m := req.Msg
	w, release, err := f.s.newDirWatch(req.Header(), m.GetPath(), m.GetRecursive(), m.GetIncludeEntry(), m.GetAllowNetworkMounts())
	if err != nil {
		return nil, err
	}
	pw := &pollWatcher{w: w, release: release, max: f.s.cfg.MaxWatcherEvents}
	id := newWatcherID()
	f.s.mu.Lock()
	if f.s.closed {
		f.s.mu.Unlock()
		release()
		return nil, errClosing
	}
	f.s.watchers[id] = pw
	f.s.wg.Add(1)
	go func() {
		defer f.s.wg.Done()
		pw.run()
	}()
	f.s.mu.Unlock()
	return connect.NewResponse(&filesystempb.CreateWatcherResponse{WatcherId: id}), nil
}

func (f *filesystemService) watcher(id string) (*pollWatcher, error) {
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	pw, ok := f.s.watchers[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %s not found", quote(id)))
	}
	return pw, nil
}

func (f *filesystemService) GetWatcherEvents(_ context.Context, req *connect.Request[filesystempb.GetWatcherEventsRequest]) (*connect.Response[filesystempb.GetWatcherEventsResponse], error) {
	pw, err := f.watcher(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	pw.mu.Lock()
	events, dropped, werr := pw.events, pw.dropped, pw.err
	pw.events, pw.dropped, pw.err = nil, 0, nil
	pw.mu.Unlock()
	if dropped > 0 {
		f.s.log.Warn("watcher dropped events", "watcher", req.Msg.GetWatcherId(), "dropped", dropped)
	}
	if werr != nil && len(events) == 0 {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("watch error: %w", werr))
	}
	return connect.NewResponse(&filesystempb.GetWatcherEventsResponse{Events: events}), nil
}

func (f *filesystemService) RemoveWatcher(_ context.Context, req *connect.Request[filesystempb.RemoveWatcherRequest]) (*connect.Response[filesystempb.RemoveWatcherResponse], error) {
	f.s.mu.Lock()
	pw, ok := f.s.watchers[req.Msg.GetWatcherId()]
	delete(f.s.watchers, req.Msg.GetWatcherId())
	f.s.mu.Unlock()
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %s not found", quote(req.Msg.GetWatcherId())))
	}
	pw.stop()
	return connect.NewResponse(&filesystempb.RemoveWatcherResponse{}), nil
}

// trackUpload records an upload temp file's progress under its target path.
// writeFile starts the temp's digits with 1 when the target existed.
func (w *dirWatch) trackUpload(ev fsnotify.Event) {
	base := filepath.Base(ev.Name)
	i := strings.LastIndex(base, ".upload-")
	target := filepath.Join(filepath.Dir(ev.Name), base[1:i])
	w.mu.Lock()
	defer w.mu.Unlock()
	if ev.Has(fsnotify.Remove) && !ev.Has(fsnotify.Rename) {
		delete(w.uploads, target) // failed upload: nothing reaches the target
		return
	}
	if w.uploads == nil {
		w.uploads = make(map[string]*upload)
	}
	up := w.uploads[target]
	if up == nil {
		up = &upload{existed: base[i+len(".upload-")] == '1'}
		w.uploads[target] = up
	}
	if ev.Has(fsnotify.Write) {
		up.wrote = true
	}
}

// takeUpload returns and forgets the upload that was renamed onto path.
func (w *dirWatch) takeUpload(path string) *upload {
	w.mu.Lock()
	defer w.mu.Unlock()
	up := w.uploads[path]
	delete(w.uploads, path)
	return up
}

// isUploadTemp reports whether base is a temp file name of writeFile
// (".<name>.upload-<digits>").
func isUploadTemp(base string) bool {
	i := strings.LastIndex(base, ".upload-")
	if !strings.HasPrefix(base, ".") || i <= 0 || i+len(".upload-") == len(base) {
		return false
	}
	for _, c := range base[i+len(".upload-"):] {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}
