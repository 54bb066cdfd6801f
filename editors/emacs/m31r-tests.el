;;; m31r-tests.el --- ERT tests for m31r.el  -*- lexical-binding: t; -*-

;; Run from the repository root:
;;
;;   emacs -batch -L editors/emacs -l editors/emacs/m31r-tests.el -f ert-run-tests-batch-and-exit
;;
;; With M31R_LSP_CMD set (e.g. "m31r lsp --socket /path") and eglot
;; available, the `m31r-eglot-*' tests also talk to that server
;; (`m31r-eglot-no-daemon-says-so-once' only when it has --no-autostart and --socket).

;;; Code:

(require 'ert)
(require 'm31r)

(ert-deftest m31r-settings-defaults ()
  (should (equal (m31r-settings)
                 '(:enable t :debounceMs 75 :debounceMode "adaptive"
                   :multiline "auto" :deadlineMs 800 :maxTokens 64 :beams nil
                   :projectContext :json-false :minProbability 0.05 :socket ""))))

(ert-deftest m31r-settings-beams ()
  ;; nil is JSON null (the daemon's --beams), as eglot's jsonrpc serializes it.
  (should (string-match-p "\"beams\":null"
                          (json-serialize (m31r-settings) :null-object nil
                                          :false-object :json-false)))
  (let ((m31r-beams 2))
    (should (equal (plist-get (m31r-settings) :beams) 2))))

(ert-deftest m31r-socket-tilde-is-the-home-directory ()
  ;; The server is run without a shell: a literal ~ would name a folder.
  (let ((process-environment (cons "HOME=/tmp/m31r-home" process-environment))
        (m31r-socket "~/d.sock"))
    (should (equal (plist-get (m31r-settings) :socket) "/tmp/m31r-home/d.sock"))
    (should (equal (m31r-command) '("m31r" "lsp" "--socket" "/tmp/m31r-home/d.sock"))))
  (let ((m31r-socket "relative/~d.sock"))
    (should (equal (plist-get (m31r-settings) :socket) "relative/~d.sock"))
    (should (equal (m31r-command) '("m31r" "lsp" "--socket" "relative/~d.sock")))))

(ert-deftest m31r-settings-false-and-socket ()
  (let ((m31r-enable nil) (m31r-socket "/tmp/d.sock"))
    (should (eq (plist-get (m31r-settings) :enable) :json-false))
    (should (equal (plist-get (m31r-settings) :socket) "/tmp/d.sock"))
    (should (equal (m31r-command) '("m31r" "lsp" "--socket" "/tmp/d.sock"))))
  (should (equal (m31r-command) '("m31r" "lsp"))))

(ert-deftest m31r-modes ()
  (should (m31r--wanted-mode-p 'rust-mode))
  (should-not (m31r--wanted-mode-p 'python-mode))
  (let ((m31r-major-modes t))
    (should (m31r--wanted-mode-p 'emacs-lisp-mode))))

(ert-deftest m31r-mode-line-strings ()
  (let ((m31r-status nil) (m31r-enable t))
    (cl-letf (((symbol-function 'm31r--running-p) (lambda () t)))
      (should (equal (m31r-mode-line) ""))
      (m31r--set-status "ready" "tiny" 41.6)
      (should (equal (m31r-mode-line) "M31R 42ms"))
      (m31r--set-status "starting" nil nil)
      (should (equal (m31r-mode-line) "M31R starting"))
      (m31r--set-status "unavailable" nil nil)
      (should (equal (m31r-mode-line) "M31R unavailable"))
      (let ((m31r-enable nil))
        (should (equal (m31r-mode-line) "M31R off"))))
    ;; the last status of a server that has exited since
    (m31r--set-status "ready" "tiny" 41.6)
    (should (equal (m31r-mode-line) ""))))

(ert-deftest m31r-json-getter ()
  (let ((h (make-hash-table :test 'equal)))
    (puthash "state" "ready" h)
    (should (equal (m31r--get h "state") "ready")))
  (should (equal (m31r--get '(:state "ready") "state") "ready")))

;; This file's folder, which holds m31r.el and its README.
(defconst m31r-tests--dir (file-name-directory (or load-file-name buffer-file-name)))

(ert-deftest m31r-readme-lists-every-setting ()
  (let ((readme (with-temp-buffer
                  (insert-file-contents (expand-file-name "README.md" m31r-tests--dir))
                  (buffer-string))))
    (dolist (member (get 'm31r 'custom-group))
      (when (eq (cadr member) 'custom-variable)
        (should (string-match-p (regexp-quote (format "| `%s` |" (car member))) readme))))))

(defmacro m31r-tests--with-fake-m31r (&rest body)
  "Run BODY with an executable `m31r' first on `exec-path'."
  (declare (indent 0))
  `(let* ((dir (make-temp-file "m31r-bin" t))
          (exec-path (cons dir exec-path)))
     (unwind-protect
         (progn
           (with-temp-file (expand-file-name "m31r" dir) (insert "#!/bin/sh\n"))
           (set-file-modes (expand-file-name "m31r" dir) #o755)
           ,@body)
       (delete-directory dir t))))

(ert-deftest m31r-eglot-registration ()
  (skip-unless (require 'eglot nil t))
  (m31r-tests--with-fake-m31r
    (let ((eglot-server-programs '((rust-mode . ("rust-analyzer")))))
      (m31r-eglot-setup)
      (m31r-eglot-setup)                  ; idempotent
      (should (equal (length eglot-server-programs) 2))
      (let ((entry (car eglot-server-programs)))
        (should (equal (car entry) '((rust-mode :language-id "rust") (rust-ts-mode :language-id "rust")
                                     (rustic-mode :language-id "rust"))))
        (let ((contact (funcall (cdr entry) nil)))
          (should (eq (car contact) 'm31r-eglot-server))
          (should (equal (seq-take (cdr contact) 2) '("m31r" "lsp")))
          (should (functionp (plist-get (cdddr contact) :initializationOptions))))))))

(ert-deftest m31r-eglot-missing-program-says-so ()
  ;; Not "Process EGLOT (...) not running": the message names the program and the setting.
  (skip-unless (require 'eglot nil t))
  (let* ((dir (make-temp-file "m31r-missing" t))
         (file (expand-file-name "lib.rs" dir))
         (m31r-major-modes '(m31r-test-rust-mode))
         (eglot-server-programs nil))
    (define-derived-mode m31r-test-rust-mode prog-mode "Rust")
    (m31r-eglot-setup)
    (with-temp-file file (insert "fn main() {}\n"))
    (with-current-buffer (find-file-noselect file)
      (m31r-test-rust-mode)
      (dolist (exe (list (expand-file-name "no-such-m31r" dir) "no-such-m31r-on-path"))
        (let* ((m31r-executable exe)
               (err (should-error (apply #'eglot (eglot--guess-contact)) :type 'user-error)))
          (should (string-match-p (regexp-quote (format "%S" exe)) (cadr err)))
          (should (string-match-p "m31r-executable" (cadr err)))
          (should-not (eglot-current-server))
          ;; C-u M-x eglot: the command is only the default of eglot's prompt, to edit there.
          (let ((current-prefix-arg '(4)))
            (should (equal (cadr (m31r--eglot-contact t)) exe)))))
      (set-buffer-modified-p nil)
      (kill-buffer))
    (delete-directory dir t)))

;; eglot started on the current buffer, waited for (it may connect asynchronously): the server, or nil.
(defun m31r-tests--start-eglot ()
  (apply #'eglot (eglot--guess-contact))
  (dotimes (_ 300)
    (unless (eglot-current-server) (accept-process-output nil 0.1)))
  (eglot-current-server))

(defmacro m31r-tests--with-server (cmd extra &rest body)
  "Run BODY with the server started as CMD and every suggestion shown (no confidence floor), with EXTRA settings.
A tiny test model's greedy answer may be empty: the tests sample it with a seed (in EXTRA)."
  (declare (indent 2))
  `(cl-letf* (((symbol-function 'm31r-command)
               (lambda () (split-string-and-unquote ,cmd)))
              (settings (symbol-function 'm31r-settings))
              ((symbol-function 'm31r-settings)
               (lambda () (append (plist-put (funcall settings) :minProbability 0) ,extra))))
     ,@body))

(ert-deftest m31r-eglot-roundtrip ()
  (let ((cmd (getenv "M31R_LSP_CMD")))
    (skip-unless (and cmd (not (string-empty-p cmd)) (require 'eglot nil t)))
    (let* ((dir (make-temp-file "m31r-eglot" t))
           (file (expand-file-name "lib.rs" dir))
           (m31r-major-modes '(m31r-test-rust-mode))
           (eglot-server-programs nil)
           (m31r-status nil)
           (m31r-beams 2))
      (define-derived-mode m31r-test-rust-mode prog-mode "Rust")
      (with-temp-file file
        (insert "fn main() {\n    let counts = 1;\n    \n}\n"))
      (m31r-tests--with-server cmd '(:temperature 1.0 :seed 11 :multiline "always" :debounceMs 0)
        (m31r-eglot-setup)
        (with-current-buffer (find-file-noselect file)
          (m31r-test-rust-mode)
          (let ((server (m31r-tests--start-eglot)))
            (should server)
            (should (object-of-class-p server 'm31r-eglot-server))
            (should (member server (m31r--eglot-servers)))
            (goto-char (point-min))
            (forward-line 2)
            (end-of-line)
            (let ((res (jsonrpc-request
                        server :textDocument/inlineCompletion
                        (append (eglot--TextDocumentPositionParams)
                                (list :context (list :triggerKind 1))))))
              (let ((items (plist-get res :items)))
                (should (vectorp items))
                (should (= (length items) 1))
                (let ((text (plist-get (aref items 0) :insertText)))
                  (should (stringp text))
                  (should (> (length text) 0)))))
            ;; m31r-beams reaches the server, at start and when pushed; nil as null (the daemon's --beams).
            (cl-flet ((beams-is (want)
                        (cl-loop repeat 50
                                 for got = (plist-get
                                            (plist-get (jsonrpc-request server :m31r/stats
                                                                        (make-hash-table))
                                                       :settings)
                                            :beams)
                                 until (equal got want)
                                 do (accept-process-output nil 0.05)
                                 finally return got)))
              (should (equal (beams-is 2) 2))
              (setq m31r-beams 3)
              (m31r-push-settings)
              (should (equal (beams-is 3) 3))
              (setq m31r-beams nil)
              (m31r-push-settings)
              (should (equal (beams-is nil) nil)))
            (m31r-toggle -1)
            (m31r-toggle 1)
            (dotimes (_ 50) (unless m31r-status (accept-process-output nil 0.1)))
            (should (string-prefix-p "M31R" (m31r-mode-line)))
            (eglot-shutdown server)
            ;; no server: the mode line no longer shows the exited one's status
            (should (equal (m31r-mode-line) ""))))))))

;; Completion is accepted and undone as a user does it: through the command loop, which puts an undo boundary
;; after each command.  Once on an empty line, once after a word the item's edit replaces.
(ert-deftest m31r-eglot-accept-then-undo ()
  (let ((cmd (getenv "M31R_LSP_CMD")))
    (skip-unless (and cmd (not (string-empty-p cmd)) (require 'eglot nil t)))
    (let* ((dir (make-temp-file "m31r-eglot" t))
           (file (expand-file-name "lib.rs" dir))
           (m31r-major-modes '(m31r-test-rust-mode))
           (eglot-server-programs nil)
           (answered nil)
           (record (lambda (fn server method &rest args)
                     (let ((res (apply fn server method args)))
                       (when (eq method :textDocument/completion) (setq answered res))
                       res))))
      (define-derived-mode m31r-test-rust-mode prog-mode "Rust")
      (with-temp-file file (insert "fn main() {}\n"))
      (m31r-tests--with-server cmd '(:temperature 1.0 :seed 11 :multiline "always" :debounceMs 0)
        (m31r-eglot-setup)
        (with-current-buffer (find-file-noselect file)
          (m31r-test-rust-mode)
          (should (m31r-tests--start-eglot))
          ;; The command loop runs in the selected window's buffer.
          (set-window-buffer (selected-window) (current-buffer))
          (let ((map (make-sparse-keymap)))
            (define-key map (kbd "C-c c") #'completion-at-point)
            (define-key map (kbd "C-c u") #'undo)
            (use-local-map map))
          (unwind-protect
              (dolist (before '("fn main() {\n    let counts = 1;\n    \n}\n"
                                "fn main() {\n    let counts = 1;\n    cou\n}\n"))
                (erase-buffer)
                (insert before)
                (buffer-disable-undo)
                (buffer-enable-undo)
                (goto-char (point-min))
                (forward-line 2)
                (end-of-line)
                (setq answered nil)
                (advice-add 'jsonrpc-request :around record)
                (unwind-protect (execute-kbd-macro (kbd "C-c c"))
                  (advice-remove 'jsonrpc-request record))
                ;; The one item, inserted whole: its edit applied to the text as it was, nothing else.
                (let* ((items (plist-get answered :items))
                       (edit (and (vectorp items) (= (length items) 1) (plist-get (aref items 0) :textEdit)))
                       (new-text (plist-get edit :newText)))
                  (should (stringp new-text))
                  (should (> (length (string-trim new-text)) 0))
                  (should (equal (buffer-string)
                                 (with-temp-buffer
                                   (insert before)
                                   (pcase-let ((`(,beg . ,end) (eglot--range-region (plist-get edit :range))))
                                     (delete-region beg end)
                                     (goto-char beg)
                                     (insert new-text))
                                   (buffer-string)))))
                ;; One undo takes all of it back.
                (execute-kbd-macro (kbd "C-c u"))
                (should (equal (buffer-string) before)))
            (set-buffer-modified-p nil)
            (eglot-shutdown (eglot-current-server))))))))

;; No daemon on the socket (and none started): the user hears it once, not at every completion attempt.
(ert-deftest m31r-eglot-no-daemon-says-so-once ()
  (let ((cmd (getenv "M31R_LSP_CMD")))
    (skip-unless (and cmd (string-match-p "--no-autostart" cmd) (string-match-p "--socket" cmd)
                      (require 'eglot nil t)))
    (let* ((dir (make-temp-file "m31r-nodaemon" t))
           (file (expand-file-name "lib.rs" dir))
           (argv (split-string-and-unquote cmd))
           (argv (append (seq-take argv (1+ (cl-position "--socket" argv :test #'equal)))
                         (list (expand-file-name "none.sock" dir))
                         (seq-drop argv (+ 2 (cl-position "--socket" argv :test #'equal)))))
           (m31r-major-modes '(m31r-test-rust-mode))
           (eglot-server-programs nil)
           (m31r-status nil)
           (shown nil)
           (note (lambda (fmt &rest args)
                   (when (stringp fmt) (push (apply #'format-message fmt args) shown)))))
      (define-derived-mode m31r-test-rust-mode prog-mode "Rust")
      (with-temp-file file (insert "fn main() {\n    let x = 1;\n    \n}\n"))
      (cl-letf (((symbol-function 'm31r-command) (lambda () argv)))
        (m31r-eglot-setup)
        (with-current-buffer (find-file-noselect file)
          (m31r-test-rust-mode)
          (advice-add 'message :before note)
          (unwind-protect
              (progn
                (should (m31r-tests--start-eglot))
                (goto-char (point-min))
                (forward-line 2)
                (end-of-line)
                ;; No item: completion-at-point says "No match" and sits for `minibuffer-message-timeout' (2 s,
                ;; a sleep in batch mode).  The server's message, if any, comes before its answer, which
                ;; completion-at-point waits for.
                (let ((minibuffer-message-timeout 0))
                  (dotimes (_ 3)
                    (insert "x")
                    (completion-at-point)
                    (accept-process-output nil 0.2)))
                (dotimes (_ 20)
                  (unless (equal (plist-get m31r-status :state) "unavailable")
                    (accept-process-output nil 0.1)))
                (should (equal (m31r-mode-line) "M31R unavailable"))
                (should (= 1 (cl-count-if (lambda (m) (string-match-p "unavailable" m)) shown))))
            (advice-remove 'message note)
            (set-buffer-modified-p nil)
            (when (eglot-current-server) (eglot-shutdown (eglot-current-server)))))))))

;; Eglot before 1.15 names the language after the mode ("rust-ts", "rustic"); the server is told "rust", which
;; it knows (completion documentation's code fence, the suffix of a document without one).  Each mode starts its
;; own server: eglot 1.9 gives all of a server's buffers the languageId of the mode that started it.
(ert-deftest m31r-eglot-rust-modes-open-as-rust ()
  (let ((cmd (getenv "M31R_LSP_CMD")))
    (skip-unless (and cmd (not (string-empty-p cmd)) (require 'eglot nil t)))
    ;; Emacs 28 has neither mode: stand-ins, not derived from rust-mode (as rustic-mode may not be).
    (unless (fboundp 'rust-ts-mode) (define-derived-mode rust-ts-mode prog-mode "Rust[ts]"))
    (unless (fboundp 'rustic-mode) (define-derived-mode rustic-mode prog-mode "Rustic"))
    (let* ((dir (make-temp-file "m31r-langid" t))
           (eglot-server-programs nil)
           (opened nil)
           (record (lambda (_conn method params)
                     (when (eq method :textDocument/didOpen)
                       (push (plist-get (plist-get params :textDocument) :languageId) opened)))))
      (m31r-tests--with-server cmd nil
        (m31r-eglot-setup)
        (dolist (mode '(rust-ts-mode rustic-mode))
          (let ((file (expand-file-name (format "%s/lib.rs" mode) dir)))
            (make-directory (file-name-directory file) t)
            (with-temp-file file (insert "fn main() {}\n"))
            (with-current-buffer (find-file-noselect file)
              (funcall mode)
              (setq opened nil)
              (advice-add 'jsonrpc-notify :before record)
              (unwind-protect
                  (should (m31r-tests--start-eglot))
                (advice-remove 'jsonrpc-notify record))
              (unwind-protect
                  (should (equal opened '("rust")))
                (set-buffer-modified-p nil)
                (eglot-shutdown (eglot-current-server))
                (kill-buffer)))))))))

;; A large file (about 2 MB) is completed like a small one, and says nothing about its size.
(ert-deftest m31r-eglot-large-file ()
  (let ((cmd (getenv "M31R_LSP_CMD")))
    (skip-unless (and cmd (not (string-empty-p cmd)) (require 'eglot nil t)))
    (let* ((dir (make-temp-file "m31r-large" t))
           (file (expand-file-name "lib.rs" dir))
           (m31r-major-modes '(m31r-test-rust-mode))
           (eglot-server-programs nil)
           (shown nil)
           (note (lambda (fmt &rest args)
                   (when (stringp fmt) (push (apply #'format-message fmt args) shown)))))
      (define-derived-mode m31r-test-rust-mode prog-mode "Rust")
      (with-temp-file file
        (dotimes (i 40000) (insert (format "pub fn f%d(x: u32) -> u32 { x + %d }\n" i i)))
        (insert "fn main() {\n    let counts = 1;\n    \n}\n"))
      (m31r-tests--with-server cmd '(:temperature 1.0 :seed 11 :debounceMs 0)
        (m31r-eglot-setup)
        (with-current-buffer (find-file-noselect file)
          (m31r-test-rust-mode)
          (advice-add 'message :before note)
          (unwind-protect
              (progn
                (should (m31r-tests--start-eglot))
                (goto-char (point-max))
                (forward-line -2)
                (end-of-line)
                (let* ((res (jsonrpc-request (eglot-current-server) :textDocument/completion
                                             (eglot--TextDocumentPositionParams)))
                       (items (if (vectorp res) res (plist-get res :items))))
                  (should (= (length items) 1)))
                (should-not (cl-find-if (lambda (m) (string-match-p "(type=1)\\|rror" m)) shown)))
            (advice-remove 'message note)
            (set-buffer-modified-p nil)
            (when (eglot-current-server) (eglot-shutdown (eglot-current-server)))))))))

(provide 'm31r-tests)
;;; m31r-tests.el ends here
