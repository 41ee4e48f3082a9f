package guest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
)

// metadataXattrPrefix is the xattr namespace of user-defined file metadata
// (envd 0.6.2: X-Metadata-<key> upload headers, EntryInfo.metadata).
const metadataXattrPrefix = "user.e2b."

// Metadata limits, as documented by envd's OpenAPI.
const (
	maxMetadataKeyBytes   = 246
	maxMetadataTotalBytes = 4096
)

// entryInfo describes path (not following a final symlink).
func entryInfo(path string, db *userDB) (*filesystempb.EntryInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	return entryInfoFrom(path, fi, db), nil
}

func entryInfoFrom(path string, fi fs.FileInfo, db *userDB) *filesystempb.EntryInfo {
	mode := fi.Mode()
	e := &filesystempb.EntryInfo{
		Name:         filepath.Base(path),
		Path:         path,
		Size:         fi.Size(),
		Mode:         uint32(mode.Perm()),
		Permissions:  mode.String(),
		ModifiedTime: timestamppb.New(fi.ModTime()),
	}
	switch {
	case mode&fs.ModeSymlink != 0:
		e.Type = filesystempb.FileType_FILE_TYPE_SYMLINK
		if t, err := os.Readlink(path); err == nil {
			if !filepath.IsAbs(t) {
				t = filepath.Join(filepath.Dir(path), t)
			}
			e.SymlinkTarget = &t
		}
	case mode.IsDir():
		e.Type = filesystempb.FileType_FILE_TYPE_DIRECTORY
	case mode.IsRegular():
		e.Type = filesystempb.FileType_FILE_TYPE_FILE
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && db != nil {
		e.Owner = db.userName(st.Uid)
		e.Group = db.groupName(st.Gid)
	}
	if mode&fs.ModeSymlink == 0 {
		e.Metadata = readMetadata(path)
	}
	return e
}

// readMetadata returns the user.e2b.* xattrs of path (best effort).
func readMetadata(path string) map[string]string {
	sz, err := unix.Llistxattr(path, nil)
	if err != nil || sz <= 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(path, buf)
	if err != nil {
		return nil
	}
	var md map[string]string
	for _, name := range strings.Split(string(buf[:sz]), "\x00") {
		key, ok := strings.CutPrefix(name, metadataXattrPrefix)
		if !ok || key == "" {
			continue
		}
		val := make([]byte, maxMetadataTotalBytes)
		n, err := unix.Lgetxattr(path, name, val)
		if err != nil {
			continue
		}
		if md == nil {
			md = make(map[string]string)
		}
		md[key] = string(val[:n])
	}
	return md
}

// writeMetadata replaces the user.e2b.* xattrs of path with md.
func writeMetadata(path string, md map[string]string) error {
	for k := range readMetadata(path) {
		if _, keep := md[k]; !keep {
			if err := unix.Lremovexattr(path, metadataXattrPrefix+k); err != nil && !errors.Is(err, unix.ENODATA) {
				return err
			}
		}
	}
	for k, v := range md {
		if err := unix.Lsetxattr(path, metadataXattrPrefix+k, []byte(v), 0); err != nil {
			return err
		}
	}
	return nil
}

// ensureDirs creates dir and its missing parents (mode 0755). Called within
// runAs, the directories belong to the user, like envd's.
func ensureDirs(dir string) error {
	st, err := os.Stat(dir)
	if err == nil {
		if !st.IsDir() {
			return &fs.PathError{Op: "mkdir", Path: dir, Err: syscall.ENOTDIR}
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if parent := filepath.Dir(dir); parent != dir {
		if err := ensureDirs(parent); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return nil
}

// fsErrorClass classifies a filesystem error for both APIs: the HTTP status
// /files answers and the Connect code filesystem.Filesystem answers. What a
// request can cause (a permission the user lacks, a read-only or full file
// system, a bad path) is a 4xx class, never 500/internal: only failures of
// the agent itself are.
func fsErrorClass(err error) (int, connect.Code) {
	switch {
	case errors.Is(err, ErrInvalidPath):
		return http.StatusBadRequest, connect.CodeInvalidArgument
	case errors.Is(err, fs.ErrNotExist):
		return http.StatusNotFound, connect.CodeNotFound
	case errors.Is(err, syscall.EROFS), errors.Is(err, fs.ErrPermission): // EACCES, EPERM
		return http.StatusForbidden, connect.CodePermissionDenied
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return http.StatusInsufficientStorage, connect.CodeResourceExhausted
	case errors.Is(err, syscall.EFBIG):
		return http.StatusRequestEntityTooLarge, connect.CodeResourceExhausted
	case errors.Is(err, syscall.EEXIST):
		return http.StatusConflict, connect.CodeAlreadyExists
	case errors.Is(err, syscall.EBUSY), errors.Is(err, syscall.ETXTBSY), errors.Is(err, syscall.EXDEV):
		return http.StatusConflict, connect.CodeFailedPrecondition
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENAMETOOLONG),
		errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ENOTEMPTY), errors.Is(err, syscall.ELOOP):
		return http.StatusBadRequest, connect.CodeInvalidArgument
	default:
		return http.StatusInternalServerError, connect.CodeInternal
	}
}

// fsError maps a filesystem error to a Connect error as envd does.
func fsError(err error, what string) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	_, code := fsErrorClass(err)
	switch code {
	case connect.CodeInvalidArgument:
		if errors.Is(err, ErrInvalidPath) {
			return connect.NewError(code, err)
		}
	case connect.CodeResourceExhausted:
		if !errors.Is(err, syscall.EFBIG) {
			return connect.NewError(code, fmt.Errorf("%s: not enough disk space: %w", what, err))
		}
	}
	return connect.NewError(code, fmt.Errorf("%s: %w", what, err))
}

type filesystemService struct{ s *Server }

// resolve authenticates the caller and resolves p against their home. Every
// file operation of the request then runs as that account (runAs).
func (f *filesystemService) resolve(h http.Header, p string) (string, *account, *userDB, error) {
	acct, db, err := f.s.userFromAuth(h)
	if err != nil {
		return "", nil, nil, err
	}
	path, err := ResolvePath(p, acct.Home)
	if err != nil {
		return "", nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	return path, acct, db, nil
}

func (f *filesystemService) Stat(_ context.Context, req *connect.Request[filesystempb.StatRequest]) (*connect.Response[filesystempb.StatResponse], error) {
	path, acct, db, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	var e *filesystempb.EntryInfo
	err = runAs(acct, func() (err error) {
		e, err = entryInfo(path, db)
		return err
	})
	if err != nil {
		return nil, fsError(err, "error getting file info for "+quote(path))
	}
	return connect.NewResponse(&filesystempb.StatResponse{Entry: e}), nil
}

func (f *filesystemService) ListDir(_ context.Context, req *connect.Request[filesystempb.ListDirRequest]) (*connect.Response[filesystempb.ListDirResponse], error) {
	path, acct, db, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.GetDepth())
	if depth == 0 {
		depth = 1
	}
	out := &filesystempb.ListDirResponse{}
	err = runAs(acct, func() error {
		real, err := filepath.EvalSymlinks(path)
		if err != nil {
			return fsError(err, "error resolving directory "+quote(path))
		}
		st, err := os.Stat(real)
		if err != nil {
			return fsError(err, "error getting directory info for "+quote(path))
		}
		if !st.IsDir() {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %s is not a directory", quote(path)))
		}
		return filepath.WalkDir(real, func(p string, d fs.DirEntry, err error) error {
			if p == real {
				return err
			}
			if err != nil {
				return nil // unreadable subtree (for this user): skip it
			}
			rel, rerr := filepath.Rel(real, p)
			if rerr != nil {
				return nil
			}
			fi, ierr := d.Info()
			if ierr != nil {
				return nil
			}
			out.Entries = append(out.Entries, entryInfoFrom(filepath.Join(path, rel), fi, db))
			if d.IsDir() && strings.Count(rel, string(filepath.Separator))+1 >= depth {
				return filepath.SkipDir
			}
			return nil
		})
	})
	if err != nil {
		return nil, fsError(err, "error reading directory "+quote(path))
	}
	return connect.NewResponse(out), nil
}

func (f *filesystemService) MakeDir(_ context.Context, req *connect.Request[filesystempb.MakeDirRequest]) (*connect.Response[filesystempb.MakeDirResponse], error) {
	path, acct, db, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	var e *filesystempb.EntryInfo
	err = runAs(acct, func() error {
		if st, err := os.Stat(path); err == nil {
			if st.IsDir() {
				return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory %s already exists", quote(path)))
			}
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %s already exists and is not a directory", quote(path)))
		}
		if err := ensureDirs(path); err != nil {
			return fsError(err, "error creating directory "+quote(path))
		}
		var err error
		if e, err = entryInfo(path, db); err != nil {
			return fsError(err, "error getting file info for "+quote(path))
		}
		return nil
	})
	if err != nil {
		return nil, fsError(err, "error creating directory "+quote(path))
	}
	return connect.NewResponse(&filesystempb.MakeDirResponse{Entry: e}), nil
}

func (f *filesystemService) Move(_ context.Context, req *connect.Request[filesystempb.MoveRequest]) (*connect.Response[filesystempb.MoveResponse], error) {
	src, acct, db, err := f.resolve(req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	dst, err := ResolvePath(req.Msg.GetDestination(), acct.Home)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	var e *filesystempb.EntryInfo
	err = runAs(acct, func() error {
		if _, err := os.Lstat(src); err != nil {
			return fsError(err, "source "+quote(src))
		}
		if err := ensureDirs(filepath.Dir(dst)); err != nil {
			return fsError(err, "error creating destination parent directory")
		}
		if err := os.Rename(src, dst); err != nil {
			return fsError(err, "error moving "+quote(src)+" to "+quote(dst))
		}
		var err error
		if e, err = entryInfo(dst, db); err != nil {
			return fsError(err, "error getting file info for "+quote(dst))
		}
		return nil
	})
	if err != nil {
		return nil, fsError(err, "error moving "+quote(src)+" to "+quote(dst))
	}
	return connect.NewResponse(&filesystempb.MoveResponse{Entry: e}), nil
}

func (f *filesystemService) Remove(_ context.Context, req *connect.Request[filesystempb.RemoveRequest]) (*connect.Response[filesystempb.RemoveResponse], error) {
	path, acct, _, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if path == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("refusing to remove /"))
	}
	if err := runAs(acct, func() error { return os.RemoveAll(path) }); err != nil {
		return nil, fsError(err, "error removing "+quote(path))
	}
	return connect.NewResponse(&filesystempb.RemoveResponse{}), nil
}
